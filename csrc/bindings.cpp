// act_hf._C: host-side argument checks and the pybind11 module. Kernels live in *_kernel.cu.
// The checks run with the GIL held (a failed TORCH_CHECK becomes a RuntimeError there); only the launch releases
// it: an argument error raised under call_guard<gil_scoped_release> segfaulted on the GPU machine (torch 2.11,
// Python 3.12).
// Messages are whole std::strings (std::to_string, c10::toString, Device::str), never streamed: on the H100
// machine (gcc 13.3) streaming an integer inside this module crashed in std::ostream::_M_insert<long>
// (benchmarks/results/gpu_h100_3/diagnosis.log), and TORCH_CHECK(cond, "got ", n) streams its arguments; a
// single std::string argument is passed through as it is.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "dispatch.h"

#define CHECK_CUDA(x) \
  TORCH_CHECK((x).is_cuda(), std::string(#x " must be a CUDA tensor, got one on ") + (x).device().str())
#define CHECK_CONTIGUOUS(x) TORCH_CHECK((x).is_contiguous(), std::string(#x " must be contiguous"))
#define CHECK_DTYPE(x, T)                                                                                   \
  TORCH_CHECK((x).scalar_type() == (T), std::string(#x " must have dtype ") + c10::toString(T) + ", got " + \
                                            c10::toString((x).scalar_type()))
#define CHECK_LENGTH(x, n)                                                                 \
  TORCH_CHECK((x).dim() == 1 && (x).size(0) == (n),                                        \
              std::string(#x " must be flat with ") + std::to_string(n) + " elements (" #n \
                  "), got shape " + act_hf::shape_str((x).sizes()))

namespace act_hf {
std::vector<at::Tensor> quantize_pack_cuda(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t seed);
std::vector<at::Tensor> quantize_pack_scaled_cuda(const at::Tensor& x, const at::Tensor& shifts, int64_t bits,
                                                  int64_t group_size, int64_t seed);
std::vector<at::Tensor> quantize_pack_normalized_cuda(const at::Tensor& x, const at::Tensor& mean,
                                                      const at::Tensor& invstd, int64_t inner, int64_t bits,
                                                      int64_t group_size, int64_t seed);
at::Tensor channel_shifts_cuda(const at::Tensor& x, int64_t channels, int64_t max_shift);
at::Tensor unpack_dequantize_cuda(const at::Tensor& payload, const at::Tensor& lo, const at::Tensor& scale,
                                  int64_t bits, int64_t group_size, int64_t numel, at::ScalarType dtype);
at::Tensor unpack_dequantize_affine_cuda(const at::Tensor& payload, const at::Tensor& lo, const at::Tensor& scale,
                                         int64_t bits, int64_t group_size, int64_t numel, const at::Tensor& mult,
                                         const at::Tensor& shift, const c10::optional<at::Tensor>& divisor);
void unpack_dequantize_chain_cuda(const at::Tensor& out, const std::vector<at::Tensor>& payloads,
                                  const std::vector<at::Tensor>& los, const std::vector<at::Tensor>& scales,
                                  const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& biases,
                                  const std::vector<c10::optional<at::Tensor>>& masks, int64_t bits,
                                  int64_t group_size, int64_t start, int64_t inner, bool accumulate);
constexpr int64_t kChainTerms = 8;  // decode_octets.cuh
at::Tensor pack_bits_cuda(const at::Tensor& codes, int64_t bits);
at::Tensor unpack_bits_cuda(const at::Tensor& payload, int64_t bits, int64_t numel);
at::Tensor fewbit_encode_pack_cuda(const at::Tensor& x, const at::Tensor& bounds, int64_t bits);
at::Tensor fewbit_grad_cuda(const at::Tensor& grad, const at::Tensor& payload, const at::Tensor& values,
                            int64_t bits);
at::Tensor zero_unmasked_cuda(const at::Tensor& values, const at::Tensor& mask, bool in_place);
at::Tensor activation_inplace_code_cuda(const at::Tensor& x, const at::Tensor& bounds, int64_t bits,
                                        const std::string& activation);
at::Tensor relu_inplace_code_cuda(const at::Tensor& x, const at::Tensor& negative_zero_out);
at::Tensor masked_scale_cuda(const at::Tensor& grad, const at::Tensor& mask, double scale);
}  // namespace act_hf

namespace {

void check_bits(int64_t bits) { TORCH_CHECK(bits >= 1 && bits <= 8, act_hf::bits_error(bits)); }

void check_group_size(int64_t group_size) {
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0,
              "group_size must be a positive multiple of 8, got " + std::to_string(group_size));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// `t` (named `name`) holds at least `need` bytes, `formula` saying how many its reader takes.
void check_holds(const at::Tensor& t, int64_t need, const char* name, const char* formula) {
  TORCH_CHECK(t.numel() >= need, std::string(name) + " holds " + std::to_string(t.numel()) + " bytes, fewer than " +
                                     formula + " = " + std::to_string(need));
}

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

// `t` (named `name` in the message) is 1-D and of a floating dtype the kernels take.
void check_flat_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 1, std::string(name) + " must be flat (1-D), got " + std::to_string(t.dim()) + " dims");
  TORCH_CHECK(is_float_type(t.scalar_type()), std::string(name) +
                                                  " must be float32, float16, bfloat16 or float64, got " +
                                                  c10::toString(t.scalar_type()));
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.device() == b.device(), std::string(what) + " must be on " + a.device().str() + ", got " +
                                            b.device().str());
}

// What both quantize entry points take: a flat, contiguous floating CUDA tensor, a width and a group size.
void check_quantize_args(const at::Tensor& x, int64_t bits, int64_t group_size) {
  CHECK_CUDA(x);
  CHECK_CONTIGUOUS(x);
  check_flat_float(x, "x");
  check_bits(bits);
  check_group_size(group_size);
}

std::vector<at::Tensor> quantize_pack(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t seed) {
  check_quantize_args(x, bits, group_size);
  py::gil_scoped_release no_gil;
  return act_hf::quantize_pack_cuda(x, bits, group_size, seed);
}

// The shifts (0..24, as act_hf.compress.quantizer makes them) are not read on the host: that would sync.
std::vector<at::Tensor> quantize_pack_scaled(const at::Tensor& x, const at::Tensor& shifts, int64_t bits,
                                             int64_t group_size, int64_t seed) {
  check_quantize_args(x, bits, group_size);
  CHECK_CONTIGUOUS(shifts);
  check_same_device(x, shifts, "shifts");
  CHECK_DTYPE(shifts, at::kInt);
  TORCH_CHECK(shifts.dim() == 1 && shifts.numel() > 0,
              "shifts must be flat with one entry per channel (at least one), got shape " +
                  act_hf::shape_str(shifts.sizes()));
  py::gil_scoped_release no_gil;
  return act_hf::quantize_pack_scaled_cuda(x, shifts, bits, group_size, seed);
}

at::Tensor channel_shifts(const at::Tensor& x, int64_t channels, int64_t max_shift) {
  CHECK_CUDA(x);
  CHECK_CONTIGUOUS(x);
  check_flat_float(x, "x");
  TORCH_CHECK(channels > 0 && x.numel() % channels == 0,
              "channels must be positive and divide x's " + std::to_string(x.numel()) + " elements, got " +
                  std::to_string(channels));
  TORCH_CHECK(max_shift >= 0 && max_shift <= 24, "max_shift must be from 0 to 24, got " + std::to_string(max_shift));
  py::gil_scoped_release no_gil;
  return act_hf::channel_shifts_cuda(x, channels, max_shift);
}

// The packed tensor a decode reads: numel elements at `bits` bits in groups of group_size.
void check_packed(const at::Tensor& payload, const at::Tensor& lo, const at::Tensor& scale, int64_t bits,
                  int64_t group_size, int64_t numel) {
  CHECK_CUDA(payload);
  CHECK_CUDA(lo);
  CHECK_CUDA(scale);
  CHECK_CONTIGUOUS(payload);
  CHECK_CONTIGUOUS(lo);
  CHECK_CONTIGUOUS(scale);
  CHECK_DTYPE(payload, at::kByte);
  CHECK_DTYPE(lo, at::kShort);
  CHECK_DTYPE(scale, at::kShort);
  check_bits(bits);
  check_group_size(group_size);
  TORCH_CHECK(numel >= 0, "numel must be >= 0, got " + std::to_string(numel));
  CHECK_LENGTH(payload, ceil_div(numel * bits, 8));
  CHECK_LENGTH(lo, ceil_div(numel, group_size));
  CHECK_LENGTH(scale, ceil_div(numel, group_size));
}

at::Tensor unpack_dequantize(const at::Tensor& payload, const at::Tensor& lo, const at::Tensor& scale, int64_t bits,
                             int64_t group_size, int64_t numel, at::ScalarType dtype) {
  check_packed(payload, lo, scale, bits, group_size, numel);
  TORCH_CHECK(is_float_type(dtype),
              std::string("dtype must be float32, float16, bfloat16 or float64, got ") + c10::toString(dtype));
  py::gil_scoped_release no_gil;
  return act_hf::unpack_dequantize_cuda(payload, lo, scale, bits, group_size, numel, dtype);
}

// A decode's per-channel factors `a` and `b` (named so in the messages): flat, contiguous fp32 tensors of one value a
// channel, beside the payload.
void check_channel_factors(const at::Tensor& payload, const at::Tensor& a, const at::Tensor& b, const char* a_name,
                           const char* b_name) {
  const at::Tensor* tensors[] = {&a, &b};
  const char* names[] = {a_name, b_name};
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK(tensors[i]->scalar_type() == at::kFloat, std::string(names[i]) + " must have dtype Float, got " +
                                                             c10::toString(tensors[i]->scalar_type()));
    check_same_device(payload, *tensors[i], names[i]);
    TORCH_CHECK(tensors[i]->is_contiguous(), std::string(names[i]) + " must be contiguous");
  }
  TORCH_CHECK(a.dim() == 1 && a.numel() > 0 && a.sizes() == b.sizes(),
              std::string(a_name) + " and " + b_name +
                  " must be flat, one value a channel (at least one), got shapes " + act_hf::shape_str(a.sizes()) +
                  " and " + act_hf::shape_str(b.sizes()));
}

at::Tensor unpack_dequantize_affine(const at::Tensor& payload, const at::Tensor& lo, const at::Tensor& scale,
                                    int64_t bits, int64_t group_size, int64_t numel, const at::Tensor& mult,
                                    const at::Tensor& shift, const c10::optional<at::Tensor>& divisor) {
  check_packed(payload, lo, scale, bits, group_size, numel);
  check_channel_factors(payload, mult, shift, "mult", "shift");
  TORCH_CHECK(numel % mult.numel() == 0, "numel must be a whole number of rows of " + std::to_string(mult.numel()) +
                                             " channels, got " + std::to_string(numel));
  if (divisor.has_value()) {
    TORCH_CHECK(divisor->scalar_type() == at::kFloat,
                "divisor must have dtype Float, got " + std::string(c10::toString(divisor->scalar_type())));
    check_same_device(payload, *divisor, "divisor");
    TORCH_CHECK(divisor->is_contiguous(), "divisor must be contiguous");
    TORCH_CHECK(divisor->numel() * mult.numel() == numel,
                "divisor must hold one value a row of " + std::to_string(mult.numel()) + " channels, " +
                    std::to_string(numel / mult.numel()) + " values, got " + std::to_string(divisor->numel()));
  }
  py::gil_scoped_release no_gil;
  return act_hf::unpack_dequantize_affine_cuda(payload, lo, scale, bits, group_size, numel, mult, shift, divisor);
}

// x's values normalized by their channel of dim 1 before grouping: (x - mean[c]) * invstd[c] for an element k of
// channel c = (k / inner) % len(mean) (BatchNorm's normalized input, packed as its input is read).
std::vector<at::Tensor> quantize_pack_normalized(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                                                 int64_t inner, int64_t bits, int64_t group_size, int64_t seed) {
  check_quantize_args(x, bits, group_size);
  TORCH_CHECK(x.scalar_type() != at::kHalf,
              "x must be float32, bfloat16 or float64 for a normalized quantize (fp16 zero points round to nearest, "
              "not below the group's normalized minimum), got Half");
  check_channel_factors(x, mean, invstd, "mean", "invstd");
  TORCH_CHECK(inner > 0, "inner must be positive, got " + std::to_string(inner));
  TORCH_CHECK(x.numel() % (inner * mean.numel()) == 0,
              "x must hold whole rows of inner * len(mean) = " + std::to_string(inner * mean.numel()) +
                  " elements, got " + std::to_string(x.numel()));
  py::gil_scoped_release no_gil;
  return act_hf::quantize_pack_normalized_cuda(x, mean, invstd, inner, bits, group_size, seed);
}

// A term of a chain decode into `out`: a packed tensor of `numel` elements, its channel factors and its mask, if any.
void check_decode_term(const at::Tensor& out, const at::Tensor& payload, const at::Tensor& lo, const at::Tensor& scale,
                       const at::Tensor& weight, const at::Tensor& bias, const c10::optional<at::Tensor>& mask,
                       int64_t bits, int64_t group_size, int64_t numel, const char* weight_name,
                       const char* bias_name, const char* mask_name) {
  check_packed(payload, lo, scale, bits, group_size, numel);
  check_channel_factors(payload, weight, bias, weight_name, bias_name);
  check_same_device(payload, out, "out");
  if (mask.has_value()) {
    TORCH_CHECK(mask->is_contiguous(), std::string(mask_name) + " must be contiguous");
    check_same_device(out, *mask, mask_name);
    TORCH_CHECK(mask->scalar_type() == at::kByte, std::string(mask_name) + " must have dtype Byte, got " +
                                                      c10::toString(mask->scalar_type()));
    check_holds(*mask, ceil_div(out.numel(), 8), mask_name, "ceil(out.numel() / 8)");
  }
}

void unpack_dequantize_chain(const at::Tensor& out, const std::vector<at::Tensor>& payloads,
                             const std::vector<at::Tensor>& los, const std::vector<at::Tensor>& scales,
                             const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& biases,
                             const std::vector<c10::optional<at::Tensor>>& masks, int64_t bits, int64_t group_size,
                             int64_t numel, int64_t start, int64_t inner, bool accumulate) {
  const size_t terms = payloads.size();
  TORCH_CHECK(terms >= 1 && terms <= static_cast<size_t>(act_hf::kChainTerms) && los.size() == terms &&
                  scales.size() == terms && weights.size() == terms && biases.size() == terms &&
                  masks.size() == terms,
              "payloads, los, scales, weights, biases and masks must hold 1 to " +
                  std::to_string(act_hf::kChainTerms) + " terms each, the same number, got " +
                  std::to_string(payloads.size()) + ", " + std::to_string(los.size()) + ", " +
                  std::to_string(scales.size()) + ", " + std::to_string(weights.size()) + ", " +
                  std::to_string(biases.size()) + " and " + std::to_string(masks.size()));
  CHECK_CUDA(out);
  CHECK_CONTIGUOUS(out);
  TORCH_CHECK(is_float_type(out.scalar_type()),
              std::string("out must be float32, float16, bfloat16 or float64, got ") +
                  c10::toString(out.scalar_type()));
  TORCH_CHECK(inner > 0, "inner must be positive, got " + std::to_string(inner));
  TORCH_CHECK(start >= 0 && start % 8 == 0 && start + out.numel() <= numel,
              "start must be a multiple of 8 from 0 with start + out.numel() <= numel (" + std::to_string(numel) +
                  "), got start " + std::to_string(start) + " and " + std::to_string(out.numel()) + " elements");
  for (size_t t = 0; t < terms; ++t) {
    const bool one = terms == 1;  // unpack_dequantize_into's names
    check_decode_term(out, payloads[t], los[t], scales[t], weights[t], biases[t], masks[t], bits, group_size, numel,
                      one ? "weight" : "weights[t]", one ? "bias" : "biases[t]", one ? "mask" : "masks[t]");
    TORCH_CHECK(weights[t].numel() == weights[0].numel(),
                "weights[t] must hold one value a channel, as weights[0] (" + std::to_string(weights[0].numel()) +
                    "), got " + std::to_string(weights[t].numel()) + " for term " + std::to_string(t));
  }
  TORCH_CHECK(out.numel() % (inner * weights[0].numel()) == 0,
              "out must hold whole rows of inner * len(weights[0]) = " + std::to_string(inner * weights[0].numel()) +
                  " elements, got " + std::to_string(out.numel()));
  py::gil_scoped_release no_gil;
  act_hf::unpack_dequantize_chain_cuda(out, payloads, los, scales, weights, biases, masks, bits, group_size, start,
                                       inner, accumulate);
}

void unpack_dequantize_into(const at::Tensor& out, const at::Tensor& payload, const at::Tensor& lo,
                            const at::Tensor& scale, int64_t bits, int64_t group_size, int64_t numel, int64_t start,
                            const at::Tensor& weight, const at::Tensor& bias, int64_t inner,
                            const c10::optional<at::Tensor>& mask, bool accumulate) {
  unpack_dequantize_chain(out, {payload}, {lo}, {scale}, {weight}, {bias}, {mask}, bits, group_size, numel, start,
                          inner, accumulate);
}

at::Tensor pack_bits(const at::Tensor& codes, int64_t bits) {
  CHECK_CUDA(codes);
  CHECK_CONTIGUOUS(codes);
  CHECK_DTYPE(codes, at::kByte);
  check_bits(bits);
  const at::Tensor flat = codes.reshape({-1});
  py::gil_scoped_release no_gil;
  return act_hf::pack_bits_cuda(flat, bits);
}

at::Tensor unpack_bits(const at::Tensor& payload, int64_t bits, int64_t numel) {
  CHECK_CUDA(payload);
  CHECK_CONTIGUOUS(payload);
  CHECK_DTYPE(payload, at::kByte);
  check_bits(bits);
  TORCH_CHECK(numel >= 0, "numel must be >= 0, got " + std::to_string(numel));
  check_holds(payload, ceil_div(numel * bits, 8), "payload", "ceil(numel * bits / 8)");
  py::gil_scoped_release no_gil;
  return act_hf::unpack_bits_cuda(payload, bits, numel);
}

// A contiguous flat float CUDA tensor x and bounds of its dtype on its device, fewer than 2**bits of them.
void check_encode_args(const at::Tensor& x, const at::Tensor& bounds, int64_t bits) {
  CHECK_CUDA(x);
  CHECK_CONTIGUOUS(x);
  CHECK_CONTIGUOUS(bounds);
  check_same_device(x, bounds, "bounds");
  check_flat_float(x, "x");
  CHECK_DTYPE(bounds, x.scalar_type());
  check_bits(bits);
  TORCH_CHECK(bounds.dim() == 1 && bounds.numel() < (int64_t{1} << bits),
              "bounds must be flat with fewer than 2**bits = " + std::to_string(int64_t{1} << bits) +
                  " elements (the codes must fit in bits), got shape " + act_hf::shape_str(bounds.sizes()));
}

at::Tensor fewbit_encode_pack(const at::Tensor& x, const at::Tensor& bounds, int64_t bits) {
  check_encode_args(x, bounds, bits);
  py::gil_scoped_release no_gil;
  return act_hf::fewbit_encode_pack_cuda(x, bounds, bits);
}

at::Tensor activation_inplace_code(const at::Tensor& x, const at::Tensor& bounds, int64_t bits,
                                   const std::string& activation) {
  TORCH_CHECK(bits >= 1 && bits <= 4,
              "bits must be 1..4 (the activations' derivative tables), got " + std::to_string(bits));
  check_encode_args(x, bounds, bits);
  py::gil_scoped_release no_gil;
  return act_hf::activation_inplace_code_cuda(x, bounds, bits, activation);
}

at::Tensor fewbit_grad(const at::Tensor& grad, const at::Tensor& payload, const at::Tensor& values, int64_t bits) {
  CHECK_CUDA(grad);
  CHECK_CONTIGUOUS(grad);
  CHECK_CONTIGUOUS(payload);
  CHECK_CONTIGUOUS(values);
  check_same_device(grad, payload, "payload");
  check_same_device(grad, values, "values");
  check_flat_float(grad, "grad");
  CHECK_DTYPE(payload, at::kByte);
  CHECK_DTYPE(values, grad.scalar_type());
  check_bits(bits);
  TORCH_CHECK(values.dim() == 1 && values.numel() == (int64_t{1} << bits),
              "values must be flat with 2**bits = " + std::to_string(int64_t{1} << bits) + " elements, got shape " +
                  act_hf::shape_str(values.sizes()));
  check_holds(payload, ceil_div(grad.numel() * bits, 8), "payload", "ceil(grad.numel() * bits / 8)");
  py::gil_scoped_release no_gil;
  return act_hf::fewbit_grad_cuda(grad, payload, values, bits);
}

// A contiguous flat float CUDA tensor `t` (named `name`) and `mask`, its 1-bit mask packed (uint8, one bit an
// element of `t`; `formula` names that count of bytes), on the same device.
void check_masked(const at::Tensor& t, const at::Tensor& mask, const char* name, const char* formula) {
  TORCH_CHECK(t.is_cuda(), std::string(name) + " must be a CUDA tensor, got one on " + t.device().str());
  TORCH_CHECK(t.is_contiguous(), std::string(name) + " must be contiguous");
  CHECK_CONTIGUOUS(mask);
  check_same_device(t, mask, "mask");
  check_flat_float(t, name);
  CHECK_DTYPE(mask, at::kByte);
  check_holds(mask, ceil_div(t.numel(), 8), "mask", formula);
}

at::Tensor zero_unmasked(const at::Tensor& values, const at::Tensor& mask, bool in_place) {
  check_masked(values, mask, "values", "ceil(values.numel() / 8)");
  py::gil_scoped_release no_gil;
  return act_hf::zero_unmasked_cuda(values, mask, in_place);
}

at::Tensor relu_inplace_code(const at::Tensor& x, const at::Tensor& negative_zero_out) {
  CHECK_CUDA(x);
  CHECK_CONTIGUOUS(x);
  check_flat_float(x, "x");
  check_same_device(x, negative_zero_out, "negative_zero_out");
  CHECK_DTYPE(negative_zero_out, x.scalar_type());
  CHECK_LENGTH(negative_zero_out, 1);
  py::gil_scoped_release no_gil;
  return act_hf::relu_inplace_code_cuda(x, negative_zero_out);
}

at::Tensor masked_scale(const at::Tensor& grad, const at::Tensor& mask, double scale) {
  check_masked(grad, mask, "grad", "ceil(grad.numel() / 8)");
  py::gil_scoped_release no_gil;
  return act_hf::masked_scale_cuda(grad, mask, scale);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "act_hf CUDA kernels: per-group stochastic quantization, bit packing and few-bit codes";
  m.def("quantize_pack", &quantize_pack, "Quantize a flat tensor and pack its codes: (payload, lo, scale)",
        py::arg("x"), py::arg("bits"), py::arg("group_size"), py::arg("seed"));
  m.def("quantize_pack_scaled", &quantize_pack_scaled,
        "quantize_pack of a flat row-major tensor whose element i is first multiplied by 2^shifts[i % len(shifts)]",
        py::arg("x"), py::arg("shifts"), py::arg("bits"), py::arg("group_size"), py::arg("seed"));
  m.def("quantize_pack_normalized", &quantize_pack_normalized,
        "quantize_pack of a flat row-major tensor whose element k of channel c = (k / inner) % len(mean) is first "
        "normalized to (x - mean[c]) * invstd[c]", py::arg("x"), py::arg("mean"), py::arg("invstd"), py::arg("inner"),
        py::arg("bits"), py::arg("group_size"), py::arg("seed"));
  m.def("channel_shifts", &channel_shifts,
        "Channel-scaling shifts (int32, one per channel) of a flat row-major tensor with `channels` channels",
        py::arg("x"), py::arg("channels"), py::arg("max_shift"));
  m.def("unpack_dequantize", &unpack_dequantize, "Unpack and dequantize into a flat tensor of dtype",
        py::arg("payload"), py::arg("lo"), py::arg("scale"), py::arg("bits"), py::arg("group_size"),
        py::arg("numel"), py::arg("dtype"));
  m.def("unpack_dequantize_affine", &unpack_dequantize_affine,
        "unpack_dequantize to float32 of a row-major tensor of len(mult) channels, each value v then v * mult[c] - "
        "shift[c] for its channel c, and with divisor times the reciprocal of its row's divisor", py::arg("payload"),
        py::arg("lo"), py::arg("scale"), py::arg("bits"), py::arg("group_size"), py::arg("numel"), py::arg("mult"),
        py::arg("shift"), py::arg("divisor") = py::none());
  m.def("unpack_dequantize_into", &unpack_dequantize_into,
        "Elements start.. of a packed tensor decoded into out, each v of channel c = (k / inner) % len(weight) "
        "mapped to v * weight[c] + bias[c], added to out's values with accumulate, zeroed where mask's bit is 0",
        py::arg("out"), py::arg("payload"), py::arg("lo"), py::arg("scale"), py::arg("bits"), py::arg("group_size"),
        py::arg("numel"), py::arg("start"), py::arg("weight"), py::arg("bias"), py::arg("inner"), py::arg("mask"),
        py::arg("accumulate"));
  m.def("unpack_dequantize_chain", &unpack_dequantize_chain,
        "unpack_dequantize_into of 1 to 8 packed tensors at once: each term decoded, mapped by its channel with "
        "weights[t] and biases[t], added (to out's values with accumulate, else from the first term) and zeroed "
        "where masks[t]'s bit is 0, in float32, rounded into out once", py::arg("out"), py::arg("payloads"),
        py::arg("los"), py::arg("scales"), py::arg("weights"), py::arg("biases"), py::arg("masks"), py::arg("bits"),
        py::arg("group_size"), py::arg("numel"), py::arg("start"), py::arg("inner"), py::arg("accumulate"));
  m.def("pack_bits", &pack_bits, "Pack uint8 codes into a dense bit stream", py::arg("codes"), py::arg("bits"));
  m.def("fewbit_encode_pack", &fewbit_encode_pack,
        "Few-bit codes #{k : bounds[k] <= x} (NaN: all of them) of a flat tensor, packed at bits each",
        py::arg("x"), py::arg("bounds"), py::arg("bits"));
  m.def("fewbit_grad", &fewbit_grad, "grad * values[code] for the packed codes of grad's elements", py::arg("grad"),
        py::arg("payload"), py::arg("values"), py::arg("bits"));
  m.def("zero_unmasked", &zero_unmasked,
        "torch.where(mask, values, 0) for a flat tensor and its 1-bit mask, packed; in place or a new tensor",
        py::arg("values"), py::arg("mask"), py::arg("in_place"));
  m.def("activation_inplace_code", &activation_inplace_code,
        "fewbit_encode_pack of a flat tensor, whose values then become the activation's ('gelu', its erf form; "
        "'gelu_tanh'; 'silu') in place", py::arg("x"), py::arg("bounds"), py::arg("bits"), py::arg("activation"));
  m.def("relu_inplace_code", &relu_inplace_code,
        "relu of a flat tensor written into it (a -0 becomes negative_zero_out[0], NaN stays); returns the 1-bit "
        "codes not (x <= 0) of its values before, packed", py::arg("x"), py::arg("negative_zero_out"));
  m.def("masked_scale", &masked_scale,
        "native_dropout_backward(grad, mask, scale) of a flat tensor and its 1-bit keep-mask, packed",
        py::arg("grad"), py::arg("mask"), py::arg("scale"));
  m.def("unpack_bits", &unpack_bits, "Unpack a dense bit stream into uint8 codes", py::arg("payload"), py::arg("bits"),
        py::arg("numel"));
}
