// C++ unit test of the kernels against at::cat / at::tensor_split on seeded
// random shapes and dtypes. Plain main (no gtest): prints each failure and
// exits non-zero if any check failed.
#include <ATen/ATen.h>

#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/pack.h"
#include "kernels/split_concat.h"

namespace pe = pipeline_ext;

namespace {

int g_failures = 0;
int g_checks = 0;

void check(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

// Runs f and checks that it throws a c10::Error whose message contains `needle`.
void check_throws(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
  } catch (const c10::Error& e) {
    check(std::string(e.what()).find(needle) != std::string::npos, "error message lacks '" + needle + "': " + e.what());
    return;
  }
  check(false, "expected an error containing '" + needle + "'");
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && at::equal(a, b);
}

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                             at::kInt,   at::kLong,   at::kBool,     at::kComplexFloat};

at::Tensor random_tensor(std::mt19937& rng, std::vector<int64_t> shape, at::ScalarType dtype) {
  at::Tensor t = at::randn(shape, at::kDouble) * 100;
  if (dtype == at::kBool) return t > 0;
  if (dtype == at::kComplexFloat) return at::randn(shape, at::kComplexFloat);
  t = t.to(dtype);
  // Half of the time make it non-contiguous with the same values.
  if (t.dim() >= 2 && rng() % 2) t = t.transpose(0, 1).contiguous().transpose(0, 1);
  return t;
}

std::vector<int64_t> random_shape(std::mt19937& rng, int64_t min_dim) {
  std::vector<int64_t> s(min_dim + rng() % (4 - min_dim));
  for (auto& v : s) v = rng() % 7;  // zeros included
  return s;
}

void test_split(std::mt19937& rng) {
  for (int iter = 0; iter < 200; ++iter) {
    const auto dtype = kDtypes[rng() % kDtypes.size()];
    const auto shape = random_shape(rng, 1);
    const at::Tensor x = random_tensor(rng, shape, dtype);
    const int64_t ndim = x.dim();
    const int64_t dim = static_cast<int64_t>(rng() % (2 * ndim)) - ndim;  // negative dims too
    const int64_t n = x.size(dim);
    std::vector<int64_t> sizes, cuts;
    int64_t left = n;
    while (left > 0 && rng() % 3) {
      const int64_t s = rng() % (left + 1);
      sizes.push_back(s);
      left -= s;
    }
    sizes.push_back(left);
    int64_t acc = 0;
    for (size_t i = 0; i + 1 < sizes.size(); ++i) cuts.push_back(acc += sizes[i]);
    const auto got = pe::split(x, sizes, dim);
    const auto want = at::tensor_split(x, cuts, dim);
    check(got.size() == want.size(), "split: piece count");
    for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
      check(got[i].is_contiguous(), "split: piece not contiguous");
      check(same(got[i], want[i]), "split: values differ from tensor_split for shape " + c10::str(x.sizes()) +
                                       " dim " + std::to_string(dim) + " sizes " + c10::str(sizes));
    }
  }
  // Contiguous batch split on dim 0 must be views.
  const at::Tensor x = at::randn({10, 4});
  for (const auto& p : pe::split(x, {3, 3, 2, 2}, 0)) check(p.is_alias_of(x), "split: dim-0 pieces should be views");
  const auto copied = pe::split(x, {1, 3}, 1);
  check(!copied[0].is_alias_of(x) && !copied[0].is_alias_of(copied[1]), "split: copies should be fresh tensors");
}

void test_concat(std::mt19937& rng) {
  for (int iter = 0; iter < 200; ++iter) {
    const auto dtype = kDtypes[rng() % kDtypes.size()];
    auto shape = random_shape(rng, 1);
    const int64_t ndim = static_cast<int64_t>(shape.size());
    const int64_t dim = static_cast<int64_t>(rng() % (2 * ndim)) - ndim;
    std::vector<at::Tensor> ts;
    const int count = 1 + rng() % 4;
    for (int i = 0; i < count; ++i) {
      shape[(dim + ndim) % ndim] = rng() % 5;
      ts.push_back(random_tensor(rng, shape, dtype));
    }
    const at::Tensor want = at::cat(ts, dim);
    check(same(pe::concat(ts, dim, std::nullopt), want), "concat: values differ from cat, shape " +
                                                             c10::str(want.sizes()) + " dim " + std::to_string(dim));
    at::Tensor out = at::empty_like(want);
    const void* ptr = out.data_ptr();
    pe::concat(ts, dim, out);
    check(out.data_ptr() == ptr && same(out, want), "concat: out= not honoured");
  }
  // Large rows go through the parallel copy plan.
  const at::Tensor a = at::randn({3, 1 << 17}), b = at::randn({3, 1 << 16});
  check(same(pe::concat({a, b}, 1, std::nullopt), at::cat({a, b}, 1)), "concat: large rows");
}

void test_pack(std::mt19937& rng) {
  for (int iter = 0; iter < 100; ++iter) {
    std::vector<at::Tensor> ts;
    const int count = rng() % 9;
    for (int i = 0; i < count; ++i) {
      ts.push_back(random_tensor(rng, random_shape(rng, 0), kDtypes[rng() % kDtypes.size()]));
    }
    auto [buffer, layout] = pe::pack(ts);
    check(buffer.scalar_type() == at::kByte && buffer.dim() == 1, "pack: buffer must be 1-D uint8");
    check(pe::PackLayout::decode(layout.encode()) == layout, "pack: encode/decode round trip");
    check(pe::PackLayout::from_tensor(layout.to_tensor()) == layout, "pack: tensor round trip");
    const auto out = pe::unpack(buffer, layout);
    check(out.size() == ts.size(), "unpack: count");
    for (size_t i = 0; i < out.size() && i < ts.size(); ++i) {
      check(layout.entries[i].offset % pe::kPackAlignment == 0, "pack: entry not aligned");
      check(same(out[i], ts[i]), "unpack: values differ for shape " + c10::str(ts[i].sizes()));
      check(out[i].numel() == 0 || out[i].is_alias_of(buffer), "unpack: not a view of the buffer");
    }
  }
}

void test_errors() {
  const at::Tensor x = at::zeros({4, 6});
  check_throws([&] { pe::split(x, {1, 2}, 0); }, "sum to 3 but dimension 0");
  check_throws([&] { pe::split(x, {-1, 5}, 0); }, "is negative");
  check_throws([&] { pe::split(x, {4}, 2); }, "dim 2 is out of range");
  check_throws([&] { pe::split(at::zeros({}), {1}, 0); }, "0-d");
  check_throws([&] { pe::concat({}, 0, std::nullopt); }, "non-empty list");
  check_throws([&] { pe::concat({x, x.to(at::kDouble)}, 0, std::nullopt); }, "tensor 1 has dtype Double");
  check_throws([&] { pe::concat({x, at::zeros({4, 5})}, 0, std::nullopt); }, "tensor 1 has shape [4, 5]");
  check_throws([&] { pe::concat({x, x}, 0, at::empty({8, 5})); }, "out has shape [8, 5]");
  auto [buffer, layout] = pe::pack({x});
  check_throws([&] { pe::unpack(buffer.narrow(0, 0, 8), layout); }, "buffer has 8 bytes");
  check_throws([&] { pe::PackLayout::decode({1, 2}); }, "not an encoded PackLayout");
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  at::manual_seed(1234);
  test_split(rng);
  test_concat(rng);
  test_pack(rng);
  test_errors();
  std::printf("test_kernels: %d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
