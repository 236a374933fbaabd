#include "kernels/pack.h"

#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/safe_numerics.h>

#include <cstring>
#include <sstream>

#include "kernels/copy.h"

namespace pipeline_ext {
namespace {

constexpr int64_t kLayoutMagic = 0x5045504b;  // "PEPK"
constexpr int64_t kLayoutVersion = 1;
constexpr int64_t kMaxDims = 64;

int64_t align_up(int64_t n) { return (n + kPackAlignment - 1) / kPackAlignment * kPackAlignment; }

bool valid_dtype(int64_t code) {
  return code >= 0 && code < static_cast<int64_t>(c10::ScalarType::NumOptions) &&
         code != static_cast<int64_t>(c10::ScalarType::Undefined);
}

// A view of `buffer`'s storage with the entry's dtype and shape (contiguous).
at::Tensor entry_view(const at::Tensor& buffer, const PackEntry& e) {
  const int64_t es = static_cast<int64_t>(c10::elementSize(e.dtype));
  return tensor_on_storage(buffer.storage(), e.dtype, (buffer.storage_offset() + e.offset) / es, e.shape);
}

// Written with SymInts so that unpack also checks a traced (fake, possibly
// dynamic-shape) buffer; on a real tensor they are plain integers.
void check_buffer(const char* op, const at::Tensor& buffer, int64_t nbytes) {
  TORCH_CHECK_TYPE(buffer.layout() == at::kStrided && !buffer.is_nested(), op,
                   ": buffer must be a dense 1-D uint8 tensor, got layout ", buffer.layout());
  const bool contiguous_1d = buffer.dim() == 1 && (buffer.sym_stride(0) == 1 || buffer.sym_size(0) <= 1);
  TORCH_CHECK_VALUE(contiguous_1d && buffer.scalar_type() == at::kByte, op,
                    ": buffer must be a contiguous 1-D uint8 tensor, got dtype ", buffer.scalar_type(),
                    " with shape ", buffer.sym_sizes(), " and strides ", buffer.sym_strides());
  TORCH_CHECK_VALUE(buffer.sym_numel() >= nbytes, op, ": buffer has ", buffer.sym_numel(),
                    " bytes but the layout needs ", nbytes);
}

// True for an ordinary CPU/CUDA tensor outside any tracing, whose entry views
// can be built directly on its storage (no dispatch per view). Fake,
// functional, batched and other wrapped tensors, and any active
// TorchDispatchMode, must see real view ops instead so that they trace them.
bool builds_views_directly(const at::Tensor& buffer) {
  return (buffer.is_cpu() || buffer.is_cuda()) && !is_wrapped(buffer) &&
         !c10::impl::TorchDispatchModeTLS::any_modes_set();
}

// Zeroes the alignment gaps between entries, so that a packed message carries
// no uninitialized memory and equal tensors always give equal buffers. On CPU
// each gap is a memset; elsewhere one fill covers the first to the last gap
// (entries are copied over it afterwards, in stream order).
void zero_gaps(const at::Tensor& buffer, const PackLayout& layout) {
  int64_t end = 0, first = -1, last = 0;
  char* base = dst_bytes(buffer);
  for (const auto& e : layout.entries) {
    const int64_t n = e.nbytes();
    if (n == 0) continue;
    if (e.offset > end) {
      if (buffer.is_cpu()) std::memset(base + end, 0, e.offset - end);
      if (first < 0) first = end;
      last = e.offset;
    }
    end = e.offset + n;
  }
  if (first >= 0 && !buffer.is_cpu()) buffer.narrow(0, first, last - first).zero_();
}

}  // namespace

int64_t PackEntry::numel() const {
  uint64_t n = 1;
  TORCH_CHECK_VALUE(!c10::safe_multiplies_u64(shape, &n) && n <= (uint64_t{1} << 62),
                    "PackLayout: shape ", shape, " has too many elements");
  return static_cast<int64_t>(n);
}

int64_t PackEntry::nbytes() const { return numel() * static_cast<int64_t>(c10::elementSize(dtype)); }

bool PackEntry::operator==(const PackEntry& o) const {
  return dtype == o.dtype && shape == o.shape && offset == o.offset;
}

bool PackLayout::operator==(const PackLayout& o) const { return nbytes == o.nbytes && entries == o.entries; }

std::vector<int64_t> PackLayout::encode() const {
  std::vector<int64_t> w = {kLayoutMagic, kLayoutVersion, static_cast<int64_t>(entries.size()), nbytes};
  for (const auto& e : entries) {
    w.push_back(static_cast<int64_t>(e.dtype));
    w.push_back(e.offset);
    w.push_back(static_cast<int64_t>(e.shape.size()));
    w.insert(w.end(), e.shape.begin(), e.shape.end());
  }
  return w;
}

PackLayout PackLayout::decode(const std::vector<int64_t>& w) {
  TORCH_CHECK_VALUE(w.size() >= 4 && w[0] == kLayoutMagic,
                    "PackLayout.decode: not an encoded PackLayout (missing header)");
  TORCH_CHECK_VALUE(w[1] == kLayoutVersion, "PackLayout.decode: unsupported layout version ", w[1],
                    " (this build reads version ", kLayoutVersion, ")");
  const int64_t n = w[2];
  TORCH_CHECK_VALUE(n >= 0 && static_cast<uint64_t>(n) <= (w.size() - 4) / 3,
                    "PackLayout.decode: entry count ", n, " does not fit in ", w.size(), " words");
  PackLayout layout;
  layout.nbytes = w[3];
  size_t pos = 4;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(pos + 3 <= w.size(), "PackLayout.decode: truncated at entry ", i);
    const int64_t dtype = w[pos], offset = w[pos + 1], ndim = w[pos + 2];
    TORCH_CHECK_VALUE(valid_dtype(dtype), "PackLayout.decode: entry ", i, " has invalid dtype code ", dtype);
    TORCH_CHECK_VALUE(ndim >= 0 && ndim <= kMaxDims && pos + 3 + ndim <= w.size(), "PackLayout.decode: entry ", i,
                      " has invalid or truncated ndim ", ndim);
    pos += 3;
    layout.entries.push_back({static_cast<c10::ScalarType>(dtype),
                              std::vector<int64_t>(w.begin() + pos, w.begin() + pos + ndim), offset});
    pos += ndim;
  }
  // A layout message travels zero-padded to a fixed size; anything else after the entries is an error.
  for (size_t i = pos; i < w.size(); ++i) {
    TORCH_CHECK_VALUE(w[i] == 0, "PackLayout.decode: ", w.size() - pos, " trailing words after the ", n,
                      " entries, and they are not zero padding");
  }
  layout.validate();
  return layout;
}

void PackLayout::validate() const {
  TORCH_CHECK_VALUE(nbytes >= 0, "PackLayout: negative nbytes ", nbytes);
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    for (int64_t s : e.shape) {
      TORCH_CHECK_VALUE(s >= 0, "PackLayout: entry ", i, " has negative size in shape ", e.shape);
    }
    const int64_t es = static_cast<int64_t>(c10::elementSize(e.dtype));
    TORCH_CHECK_VALUE(e.offset >= 0 && e.offset % es == 0, "PackLayout: entry ", i, " (dtype ", e.dtype,
                      ") has byte offset ", e.offset, ", which is not a non-negative multiple of its element size ",
                      es);
    TORCH_CHECK_VALUE(e.offset <= nbytes && e.nbytes() <= nbytes - e.offset, "PackLayout: entry ", i, " (",
                      e.nbytes(), " bytes at offset ", e.offset, ") ends past the layout's ", nbytes, " bytes");
  }
}

at::Tensor PackLayout::to_tensor() const {
  const auto w = encode();
  return at::tensor(w, at::TensorOptions().dtype(at::kLong));
}

PackLayout PackLayout::from_tensor(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.scalar_type() == at::kLong,
                    "PackLayout.from_tensor: expected a 1-D int64 tensor, got dtype ", t.scalar_type(),
                    " and shape ", t.sizes());
  const at::Tensor c = t.to(at::kCPU).contiguous();
  const int64_t* p = c.const_data_ptr<int64_t>();
  return decode(std::vector<int64_t>(p, p + c.numel()));
}

std::string PackLayout::repr() const {
  std::ostringstream os;
  os << "PackLayout(nbytes=" << nbytes << ", entries=[";
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    os << (i ? ", " : "") << "(" << e.dtype << ", " << at::IntArrayRef(e.shape) << ", offset=" << e.offset << ")";
  }
  os << "])";
  return os.str();
}

PackLayout layout_of(at::TensorList tensors) {
  PackLayout layout;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.device() == tensors[0].device(), "pack: tensor ", i, " is on device ", t.device(),
                      " but tensor 0 is on device ", tensors[0].device(), "; all tensors must be on one device");
    TORCH_CHECK_TYPE(!t.is_nested(), "pack: tensor ", i, " is a nested tensor; pack plain dense tensors "
                     "(.to_padded_tensor(0))");
    TORCH_CHECK_VALUE(t.layout() == at::kStrided && !t.is_quantized(), "pack: tensor ", i,
                      " is not a dense tensor (layout ", t.layout(), ", dtype ", t.scalar_type(), ")");
    // Empty tensors take no space (offset 0 keeps them inside any buffer).
    const int64_t offset = t.numel() == 0 ? 0 : align_up(layout.nbytes);
    layout.entries.push_back({t.scalar_type(), t.sizes().vec(), offset});
    if (t.numel() > 0) layout.nbytes = offset + t.nbytes();
  }
  return layout;
}

std::pair<at::Tensor, PackLayout> pack(at::TensorList tensors, const std::optional<at::Tensor>& out) {
  PackLayout layout = layout_of(tensors);
  const at::Device device = tensors.empty() ? at::Device(at::kCPU) : tensors[0].device();
  at::Tensor buffer;
  if (out.has_value()) {
    buffer = *out;
    check_buffer("pack", buffer, layout.nbytes);
    TORCH_CHECK_VALUE(buffer.storage_offset() % kPackAlignment == 0, "pack: out starts at storage byte ",
                      buffer.storage_offset(), ", not a multiple of ", kPackAlignment);
    TORCH_CHECK_VALUE(buffer.device() == device, "pack: out is on device ", buffer.device(),
                      " but the tensors are on device ", device);
  } else {
    buffer = at::empty({layout.nbytes}, at::TensorOptions().dtype(at::kByte).device(device));
  }
  // Reads the tensors' bytes directly: also when a channel calls it, outside the dispatcher.
  for (size_t i = 0; i < tensors.size(); ++i) check_readable(tensors[i], "pack", static_cast<int64_t>(i));
  if (out.has_value()) check_readable(buffer, "pack: out", -1);
  c10::NoGradGuard no_grad;
  zero_gaps(buffer, layout);
  CopyPlan plan;
  char* base = dst_bytes(buffer);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    if (is_plain(t)) {
      plan.add(src_bytes(t), base + layout.entries[i].offset, t.nbytes());
    } else {
      entry_view(buffer, layout.entries[i]).copy_(t);  // strided: each element copied once
    }
  }
  plan.run(device);
  return {buffer, layout};
}

std::vector<at::Tensor> unpack(const at::Tensor& buffer, const PackLayout& layout) {
  check_buffer("unpack", buffer, layout.nbytes);
  layout.validate();
  const bool direct = builds_views_directly(buffer);
  std::vector<at::Tensor> out;
  out.reserve(layout.entries.size());
  for (size_t i = 0; i < layout.entries.size(); ++i) {
    const auto& e = layout.entries[i];
    const int64_t es = static_cast<int64_t>(c10::elementSize(e.dtype));
    TORCH_CHECK_VALUE((buffer.sym_storage_offset() + e.offset) % es == 0, "unpack: entry ", i, " (dtype ", e.dtype,
                      ") would start at storage byte ", buffer.sym_storage_offset() + e.offset,
                      ", not a multiple of its element size ", es, "; unpack a buffer that starts aligned");
    if (direct) {
      out.push_back(entry_view(buffer, e));
    } else {  // the same view as aten view ops, which tracing records
      out.push_back(buffer.narrow(0, e.offset, e.nbytes()).view(e.dtype).view(e.shape));
    }
  }
  return out;
}

}  // namespace pipeline_ext
