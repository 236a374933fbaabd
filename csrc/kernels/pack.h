// Pack several tensors into one byte buffer so they travel to a peer as ONE
// message (one send, one receive, one allocation), and unpack them on the other
// side as views of the received buffer, without a copy.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pipeline_ext {

// Every entry starts on a 64-byte boundary: enough for any dtype and for
// vectorised access on both CPU and GPU.
constexpr int64_t kPackAlignment = 64;

struct PackEntry {
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t offset;  // in bytes from the start of the buffer

  int64_t numel() const;
  int64_t nbytes() const;
  bool operator==(const PackEntry& other) const;
};

// Where each tensor lives in a packed buffer. It is plain data so the runtime
// can send it ahead of (or beside) the buffer as an int64 tensor.
struct PackLayout {
  std::vector<PackEntry> entries;
  int64_t nbytes = 0;  // bytes of the buffer that the entries use

  // [magic, version, n, nbytes, then per entry: dtype, offset, ndim, dims...]
  std::vector<int64_t> encode() const;
  // Inverse of encode(); rejects malformed input with an error naming the problem.
  // Zero words after the entries are accepted: layout messages travel zero-padded.
  static PackLayout decode(const std::vector<int64_t>& words);
  at::Tensor to_tensor() const;                        // 1-D int64 CPU tensor of encode()
  static PackLayout from_tensor(const at::Tensor& t);  // any device, 1-D int64
  // Checks that every entry is well-formed and fits inside `nbytes`.
  void validate() const;
  std::string repr() const;
  bool operator==(const PackLayout& other) const;
};

// The layout pack() gives `tensors` (checks they share a device and are dense),
// without copying anything: what a sender compares with an agreed layout.
PackLayout layout_of(at::TensorList tensors);

// Copies every tensor (any dtype/shape, contiguous or not; all on one device)
// into a 1-D uint8 buffer on that device, in one copy pass. The buffer is `out`
// when given (a contiguous 1-D uint8 tensor with at least layout.nbytes bytes,
// e.g. a reused send buffer), else freshly allocated with exactly that size.
std::pair<at::Tensor, PackLayout> pack(at::TensorList tensors, const std::optional<at::Tensor>& out = std::nullopt);

// Views of `buffer` (which must be a contiguous 1-D uint8 tensor of at least
// layout.nbytes bytes) with the dtypes and shapes of `layout`; they share the
// buffer's storage, so nothing is copied. On a plain tensor they are built
// directly on the storage; on a traced one (fake, functional, under a dispatch
// mode) with narrow/view ops, so that torch.compile and export see real views.
std::vector<at::Tensor> unpack(const at::Tensor& buffer, const PackLayout& layout);

}  // namespace pipeline_ext
