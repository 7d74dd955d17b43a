"""A row-invariant CPU linear: every output row is computed by the same code, whatever the row count.

Exactness under speculation (DESIGN §1, §6) needs a k-token verify forward to compute each row as
the one-token decode step does, bit for bit. BLAS does not promise that: MKL runs one row through
gemv and several through a blocked gemm, whose sums round differently (measured here: ~5e-5 apart
in the logits of the embedded model), and :mod:`spectoolkit.models.kernel_choice` pays for
invariance with one call per row — k reads of every weight for a k-row verify.

This kernel reads each weight row once per call and takes, for every input row, the same fixed-order
dot product: one 16-lane partial sum over k (AVX-512; a 16-accumulator loop elsewhere), a fixed
reduction tree, then the scalar tail. Rows are processed in groups (four input rows against four or
eight weight rows) that only interleave independent sums, and one output element is always computed
whole by one thread, so neither the row count, the grouping nor the thread split changes a bit. A
one-row call streams the weights like MKL's gemv (measured equal on the embedded model's shapes);
4 and 8 rows cost 1.2-1.8x one row here (compute-limited), against k reads of the weights for k
one-row calls. ``paged_attention`` does the same for attention over the paged KV pool: each (query
row, head) attends the slots its sequence lists for it, in position order, with fixed-order sums.

Built once per machine with torch's C++ extension loader (gcc; ``-O3 -march=native -fopenmp``, cached
under torch's extensions directory, named per CPU so a shared home never loads another CPU's build),
exposed as the custom ops ``torch.ops.spectoolkit.row_linear`` / ``paged_attention`` so a compiled
graph calls them as extern kernels. fp32 activations; fp32 or bf16 weights; KV as the pool stores it; fp32 output.
:func:`reference_row_linear` is the plain-torch reference (the paged attention's is the eager runner's).
"""

from __future__ import annotations

import functools
import hashlib
import os

import torch

from spectoolkit.errors import SpecToolkitError, first_line

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift, exact
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// R input rows against NW weight rows. Per (row, weight row): one 16-lane partial sum over k in steps
// of 16, reduced by a fixed shuffle tree, then the scalar tail. That arithmetic is the same for every
// R and NW (they only interleave independent sums, for memory-level parallelism and register reuse:
// each loaded weight vector serves R rows, each loaded input vector NW weight rows), so the grouping
// changes no bit.
template <int R, int NW, typename W>
inline void block(const float* x, int64_t ldx, const W* w, int64_t K, float* out, int64_t ldo) {
  __m512 acc[R][NW];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NW; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NW];
    for (int j = 0; j < NW; ++j) wv[j] = load16(w + j * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
      for (int j = 0; j < NW; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NW; ++j) {
      float tail = 0.f;
      for (int64_t t = k; t < K; ++t) tail += x[r * ldx + t] * widen(w[j * K + t]);
      out[r * ldo + j] = _mm512_reduce_add_ps(acc[r][j]) + tail;
    }
  }
}
#else
// Portable fallback: 16 independent partial sums (vectorized by the compiler), a fixed tree, the tail.
template <int R, int NW, typename W>
inline void block(const float* x, int64_t ldx, const W* w, int64_t K, float* out, int64_t ldo) {
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < NW; ++j) {
      const float* xr = x + r * ldx;
      const W* wj = w + j * K;
      float acc[16] = {0};
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        for (int i = 0; i < 16; ++i) acc[i] += xr[k + i] * widen(wj[k + i]);
      for (int h = 8; h > 0; h /= 2)
        for (int i = 0; i < h; ++i) acc[i] += acc[i + h];
      float tail = 0.f;
      for (; k < K; ++k) tail += xr[k] * widen(wj[k]);
      out[r * ldo + j] = acc[0] + tail;
    }
  }
}
#endif

// Rows of x in fours (then 3, 2 or 1) against NW weight rows at a time.
template <int NW, typename W>
inline void rows_against(const float* x, const W* w, float* out, int64_t M, int64_t N, int64_t K) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) block<4, NW>(x + m * K, K, w, K, out + m * N, N);
  switch (M - m) {
    case 3: block<3, NW>(x + m * K, K, w, K, out + m * N, N); break;
    case 2: block<2, NW>(x + m * K, K, w, K, out + m * N, N); break;
    case 1: block<1, NW>(x + m * K, K, w, K, out + m * N, N); break;
    default: break;
  }
}

// Weight rows eight at a time for one input row (eight independent sums in flight), four otherwise.
template <typename W>
void run(const float* x, const W* w, const float* bias, float* out, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    if (M == 1) {
      for (; n + 8 <= n1; n += 8) rows_against<8>(x, w + n * K, out + n, M, N, K);
    }
    for (; n + 4 <= n1; n += 4) rows_against<4>(x, w + n * K, out + n, M, N, K);
    for (; n < n1; ++n) rows_against<1>(x, w + n * K, out + n, M, N, K);
    if (bias)
      for (int64_t r = 0; r < M; ++r)
        for (int64_t j = n0; j < n1; ++j) out[r * N + j] += bias[j];
  });
}

at::Tensor row_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "row_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "row_linear: fp32 activations");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto out = at::empty({M, N}, xc.options());
  at::Tensor bc;
  const float* b = nullptr;
  if (bias.has_value()) {
    bc = bias->to(at::kFloat).contiguous();
    b = bc.data_ptr<float>();
  }
  if (wc.scalar_type() == at::kFloat) {
    run(xc.data_ptr<float>(), wc.data_ptr<float>(), b, out.data_ptr<float>(), M, N, K);
  } else {
    TORCH_CHECK(wc.scalar_type() == at::kBFloat16, "row_linear: fp32 or bf16 weights");
    run(xc.data_ptr<float>(), wc.data_ptr<c10::BFloat16>(), b, out.data_ptr<float>(), M, N, K);
  }
  return out;
}

// Paged attention: the step's new keys/values go to their pool slots first (``write`` >= 0), then every
// (row, head) attends the slots ``key_slots[starts[row] : starts[row + 1]]`` in that order (a sequence's
// positions [0, row's own], a tree row's prefix and ancestors): scores by the linear's fixed-order dot,
// max-subtracted exp, the weighted value sum accumulated slot by slot in order. A stored row widens to
// fp32 (times its per-row scale for int8/fp8) before the dot, so a row's result depends only on its query
// and the slots it lists, never on the other rows of the call.
inline float widen(c10::Half v) { return static_cast<float>(v); }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(c10::Float8_e4m3fn v) { return static_cast<float>(v); }

template <typename KV>
inline const float* as_floats(const KV* src, const float* scale, int64_t D, float* buf) {
  const float s = scale ? *scale : 1.f;
  for (int64_t d = 0; d < D; ++d) buf[d] = scale ? widen(src[d]) * s : widen(src[d]);
  return buf;
}
template <>
inline const float* as_floats(const float* src, const float* scale, int64_t D, float* buf) {
  if (!scale) return src;
  for (int64_t d = 0; d < D; ++d) buf[d] = src[d] * *scale;
  return buf;
}

template <typename KV>
void paged_attend(const float* q, const KV* k, const KV* v, const float* ks, const float* vs, const int64_t* slots,
                  const int64_t* starts, float* out, int64_t W, int64_t Hq, int64_t Hkv, int64_t num_slots, int64_t D,
                  float scale) {
  const int64_t rep = Hq / Hkv;
  at::parallel_for(0, W * Hq, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores, acc(D), buf(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = i / Hq, head = i % Hq, group = head / rep;
      const int64_t first = starts[row], len = starts[row + 1] - first;
      const float* qi = q + (row * Hq + head) * D;
      const int64_t base = group * num_slots;
      scores.resize(len);
      float top = -INFINITY;
      for (int64_t j = 0; j < len; ++j) {
        const int64_t s = base + slots[first + j];
        block<1, 1>(qi, D, as_floats(k + s * D, ks ? ks + s : nullptr, D, buf.data()), D, &scores[j], 1);
        scores[j] *= scale;
        top = std::max(top, scores[j]);
      }
      float total = 0.f;
      for (int64_t j = 0; j < len; ++j) {
        scores[j] = std::exp(scores[j] - top);
        total += scores[j];
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < len; ++j) {
        const int64_t s = base + slots[first + j];
        const float* vrow = as_floats(v + s * D, vs ? vs + s : nullptr, D, buf.data());
        for (int64_t d = 0; d < D; ++d) acc[d] += scores[j] * vrow[d];
      }
      float* o = out + (row * Hq + head) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] / total;
    }
  });
}

// new [W, Hkv, width] rows to store [Hkv, num_slots, width] at slot write[i] (skipped where write[i] < 0).
void store_rows(const at::Tensor& fresh, const at::Tensor& store, const int64_t* write) {
  if (store.numel() == 0) return;
  TORCH_CHECK(store.is_contiguous() && fresh.scalar_type() == store.scalar_type(), "paged_attention: store dtype");
  auto f = fresh.contiguous();
  const int64_t W = f.size(0), H = store.size(0), slots = store.size(1), bytes = store.size(2) * store.element_size();
  const char* src = static_cast<const char*>(f.data_ptr());
  char* dst = static_cast<char*>(store.data_ptr());
  for (int64_t i = 0; i < W; ++i) {
    if (write[i] < 0) continue;
    TORCH_CHECK(write[i] < slots, "paged_attention: write slot outside the pool");
    for (int64_t h = 0; h < H; ++h) std::memcpy(dst + (h * slots + write[i]) * bytes, src + (i * H + h) * bytes, bytes);
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                           const at::Tensor& k_scale_new, const at::Tensor& v_scale_new, at::Tensor k, at::Tensor v,
                           at::Tensor k_scale, at::Tensor v_scale, const at::Tensor& write, const at::Tensor& key_slots,
                           const at::Tensor& starts, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "paged_attention: q [W, Hq, D], k/v [H, S, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == v.scalar_type(), "paged_attention: fp32 q");
  auto qc = q.contiguous();
  auto wc = write.to(at::kLong).contiguous();
  auto sc = key_slots.to(at::kLong).contiguous();
  auto st = starts.to(at::kLong).contiguous();
  const int64_t W = qc.size(0), Hq = qc.size(1), D = qc.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(wc.numel() == W && st.numel() == W + 1 && Hq % Hkv == 0 && k.size(2) == D, "paged_attention: shapes");
  TORCH_CHECK(sc.numel() == 0 || (sc.max().item<int64_t>() < S && sc.min().item<int64_t>() >= 0),
              "paged_attention: key slot outside the pool");
  const int64_t* w = wc.data_ptr<int64_t>();
  store_rows(k_new, k, w);
  store_rows(v_new, v, w);
  store_rows(k_scale_new, k_scale, w);
  store_rows(v_scale_new, v_scale, w);
  auto out = at::empty_like(qc);
  const float* ks = k_scale.numel() ? k_scale.data_ptr<float>() : nullptr;
  const float* vs = v_scale.numel() ? v_scale.data_ptr<float>() : nullptr;
  const float s = static_cast<float>(scale);
  const int64_t* slots = sc.data_ptr<int64_t>();
  const int64_t* first = st.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float* qp = qc.data_ptr<float>();
  auto run = [&](auto* kp, auto* vp) { paged_attend(qp, kp, vp, ks, vs, slots, first, o, W, Hq, Hkv, S, D, s); };
  switch (k.scalar_type()) {
    case at::kFloat: run(k.data_ptr<float>(), v.data_ptr<float>()); break;
    case at::kBFloat16: run(k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: run(k.data_ptr<c10::Half>(), v.data_ptr<c10::Half>()); break;
    case at::kChar: run(k.data_ptr<int8_t>(), v.data_ptr<int8_t>()); break;
    case at::kFloat8_e4m3fn: run(k.data_ptr<c10::Float8_e4m3fn>(), v.data_ptr<c10::Float8_e4m3fn>()); break;
    default: TORCH_CHECK(false, "paged_attention: KV stored as fp32, bf16, fp16, int8 or fp8");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(spectoolkit, m) {
  m.def("row_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor k_scale_new, Tensor v_scale_new, "
        "Tensor(a!) k, Tensor(b!) v, Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor write, Tensor key_slots, "
        "Tensor starts, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(spectoolkit, CPU, m) {
  m.impl("row_linear", &row_linear);
  m.impl("paged_attention", &paged_attention);
}
"""

WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def load_row_linear() -> None:
    """Build (first time on a machine, ~1 min) and load the kernel; registers ``torch.ops.spectoolkit.row_linear``."""
    from torch.utils.cpp_extension import load_inline

    try:
        load_inline(
            name=f"spectoolkit_row_linear_{_cpu_tag()}",
            cpp_sources=[_SOURCE],
            extra_cflags=["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=os.environ.get("SPECTOOLKIT_VERBOSE_BUILD") == "1",
        )
    except (RuntimeError, OSError) as exc:  # no compiler, or a failed build
        raise SpecToolkitError(
            f"cannot build the row-invariant linear kernel ({first_line(exc)}): "
            "install gcc or use runtime.compile=false"
        ) from None
    torch.library.register_fake("spectoolkit::row_linear")(_fake_row_linear)
    torch.library.register_fake("spectoolkit::paged_attention")(_fake_paged_attention)


def _cpu_tag() -> str:
    """A short tag of this CPU (model and ISA torch detects): ``-march=native`` builds are per CPU."""
    from spectoolkit.models.kernel_choice import cpu_model

    text = f"{cpu_model()}|{torch.backends.cpu.get_cpu_capability()}"
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _fake_row_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Shape of the output for tracing: x [M, K], w [N, K] -> [M, N] fp32."""
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


def _fake_paged_attention(q, *args) -> torch.Tensor:
    """q [W, Hq, D] -> [W, Hq, D] fp32, for tracing."""
    return torch.empty_like(q)


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (any float dtype) @ weight[N, K]ᵀ (+ bias) -> [..., N] in x's dtype, row-invariantly."""
    rows = x.reshape(-1, x.shape[-1]).float()  # [M, K]
    out = torch.ops.spectoolkit.row_linear(rows, weight, bias)  # [M, N] fp32
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def reference_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: the same product in fp64 (what the kernel approximates in fp32), cast to x's dtype."""
    out = x.double() @ weight.double().t()
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
