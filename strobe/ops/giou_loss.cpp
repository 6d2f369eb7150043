// giou / giou_packed / generalized_box_iou_loss: argument checks, autograd, and the CPU reference (ATen ops in
// double, the same formula and gradient as strobe/ops/cuda/giou_kernels.cu).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "strobe/ops/internal.h"
#include "strobe/ops/ops.h"

namespace strobe::ops {
namespace {

using at::Tensor;
using detail::kMean;
using detail::kNone;
using detail::kPacked;
using detail::kPackedTargets;
using detail::kPadded;
using detail::kSum;

constexpr double kEps = 1e-5;

bool is_float(const Tensor& t) { return at::isFloatingType(t.scalar_type()); }

// Shape and dtype checks shared by both devices.
void check_inputs(const Tensor& pred, const Tensor& target, const std::optional<Tensor>& offsets,
                  int64_t layout) {
  TORCH_CHECK(pred.defined() && target.defined(), "giou_loss: pred and target must be defined");
  TORCH_CHECK(is_float(pred), "giou_loss: pred must be floating point, got ", pred.scalar_type());
  TORCH_CHECK(is_float(target), "giou_loss: target must be floating point, got ",
              target.scalar_type());
  TORCH_CHECK(pred.device() == target.device(), "giou_loss: pred is on ", pred.device(),
              " but target is on ", target.device());
  TORCH_CHECK(pred.dim() >= 1 && pred.size(-1) == 4, "giou_loss: pred must be [..., 4], got ",
              pred.sizes());
  TORCH_CHECK(target.dim() >= 1 && target.size(-1) == 4,
              "giou_loss: target must be [..., 4], got ", target.sizes());
  switch (layout) {
    case kPadded:
      TORCH_CHECK(pred.dim() == 3, "giou_loss: pred must be [B, N, 4], got ", pred.sizes());
      TORCH_CHECK(pred.sizes() == target.sizes(), "giou_loss: pred ", pred.sizes(),
                  " and target ", target.sizes(), " must have the same shape");
      break;
    case kPacked:
    case kPackedTargets: {
      TORCH_CHECK(offsets.has_value() && offsets->defined(),
                  "giou_loss_packed: offsets must be given");
      const Tensor& off = *offsets;
      TORCH_CHECK(off.scalar_type() == at::kLong, "giou_loss_packed: offsets must be int64, got ",
                  off.scalar_type());
      TORCH_CHECK(off.dim() == 1 && off.size(0) >= 1,
                  "giou_loss_packed: offsets must be [B + 1], got ", off.sizes());
      TORCH_CHECK(off.device() == pred.device(), "giou_loss_packed: offsets are on ", off.device(),
                  " but pred is on ", pred.device());
      TORCH_CHECK(target.dim() == 2, "giou_loss_packed: target must be [T, 4], got ",
                  target.sizes());
      if (layout == kPacked) {
        TORCH_CHECK(pred.dim() == 2 && pred.size(0) == target.size(0),
                    "giou_loss_packed: packed pred must be [T, 4] like target ", target.sizes(),
                    ", got ", pred.sizes());
      } else {
        TORCH_CHECK(pred.dim() == 3 && pred.size(0) == off.size(0) - 1,
                    "giou_loss_packed: padded pred must be [B, N, 4] with B = offsets.size(0) - 1 = ",
                    off.size(0) - 1, ", got ", pred.sizes());
      }
      if (off.device().is_cpu()) {
        // Cheap on CPU; on CUDA reading the offsets would sync, the kernel guards instead.
        const Tensor o = off.contiguous();
        const int64_t* v = o.data_ptr<int64_t>();
        const int64_t n = o.size(0);
        TORCH_CHECK(v[0] == 0, "giou_loss_packed: offsets[0] must be 0, got ", v[0]);
        TORCH_CHECK(v[n - 1] == target.size(0), "giou_loss_packed: offsets[-1] = ", v[n - 1],
                    " must equal the number of target rows ", target.size(0));
        const int64_t cap = layout == kPackedTargets ? pred.size(1) : target.size(0);
        for (int64_t i = 0; i + 1 < n; ++i) {
          TORCH_CHECK(v[i + 1] >= v[i], "giou_loss_packed: offsets must be non-decreasing (at ",
                      i, ")");
          TORCH_CHECK(v[i + 1] - v[i] <= cap, "giou_loss_packed: image ", i, " has ",
                      v[i + 1] - v[i], " targets but pred holds ", cap, " boxes per image");
        }
      }
      break;
    }
    default: TORCH_CHECK(false, "giou_loss: unknown layout ", layout);
  }
}

at::ScalarType giou_loss_dtype(const Tensor& pred) {
  return pred.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// d max(self, other) / d other under autograd's tie rule (half each).
Tensor win_max(const Tensor& other, const Tensor& self) {
  return at::gt(other, self).to(at::kDouble) + 0.5 * at::eq(other, self).to(at::kDouble);
}
Tensor win_min(const Tensor& other, const Tensor& self) {
  return at::lt(other, self).to(at::kDouble) + 0.5 * at::eq(other, self).to(at::kDouble);
}

std::tuple<Tensor, Tensor, Tensor> giou_fwd_cpu(const Tensor& pred, const Tensor& target,
                                                const std::optional<Tensor>& offsets,
                                                int64_t layout, int64_t reduction,
                                                bool with_grad) {
  check_inputs(pred, target, offsets, layout);
  TORCH_CHECK(reduction == kNone || reduction == kMean || reduction == kSum,
              "giou_loss: unknown reduction ", reduction);
  const Tensor p = pred.reshape({-1, 4}).to(at::kDouble);
  const int64_t rows = p.size(0);
  const auto dopt = p.options();
  Tensor t, valid;
  if (layout == kPackedTargets) {
    const int64_t images = pred.size(0), n = pred.size(1);
    const Tensor off = offsets->to(at::kLong);
    const Tensor begin = off.slice(0, 0, images), count = off.slice(0, 1) - begin;
    const Tensor j = at::arange(n, off.options());
    valid = (j.unsqueeze(0) < count.unsqueeze(1)).reshape({-1});
    const Tensor trow = (begin.unsqueeze(1) + j.unsqueeze(0)).reshape({-1});
    const Tensor tall = target.to(at::kDouble);
    t = tall.size(0) == 0
            ? at::zeros({rows, 4}, dopt)
            : tall.index_select(0, at::where(valid, trow, at::zeros_like(trow))) *
                  valid.unsqueeze(1);
  } else {
    t = target.reshape({-1, 4}).to(at::kDouble);
    valid = layout == kPadded ? at::gt(t.select(1, 3), 0.0)
                              : at::ones({rows}, dopt.dtype(at::kBool));
  }
  const Tensor t0 = t.select(1, 0), t1 = t.select(1, 1), t2 = t.select(1, 2), t3 = t.select(1, 3);
  const Tensor p0 = p.select(1, 0), p1 = p.select(1, 1), p2 = p.select(1, 2), p3 = p.select(1, 3);
  const Tensor area1 = (t2 - t0) * (t3 - t1);
  const Tensor pw = p2 - p0, ph = p3 - p1;
  // Overlap sides clamped at 0 (standard GIoU, as torchvision.ops.generalized_box_iou).
  const Tensor w_raw = at::minimum(t2, p2) - at::maximum(t0, p0);
  const Tensor h_raw = at::minimum(t3, p3) - at::maximum(t1, p1);
  const Tensor w = at::clamp_min(w_raw, 0.0), h = at::clamp_min(h_raw, 0.0);
  const Tensor inter = w * h;
  const Tensor uni = area1 + pw * ph - inter;
  const Tensor uc = at::clamp_min(uni, kEps);
  const Tensor ew = at::maximum(t2, p2) - at::minimum(t0, p0);
  const Tensor eh = at::maximum(t3, p3) - at::minimum(t1, p1);
  const Tensor ea_raw = ew * eh;
  const Tensor ea = at::clamp_min(ea_raw, kEps);
  const Tensor giou = inter / uc - (ea - uni) / ea;
  const Tensor per_box = at::where(valid, giou, at::zeros_like(giou));

  const int64_t count = valid.sum().item<int64_t>();
  const double scale = reduction == kMean ? 1.0 / static_cast<double>(std::max<int64_t>(count, 1))
                                          : 1.0;
  Tensor loss;
  if (reduction == kNone) {
    loss = per_box.reshape(pred.sizes().slice(0, pred.dim() - 1)).to(giou_loss_dtype(pred));
  } else {
    loss = (per_box.sum() * scale).to(giou_loss_dtype(pred));
  }
  Tensor grad_box;
  if (with_grad) {
    const Tensor zero = at::zeros_like(giou);
    const Tensor g_ea = at::where(ea_raw >= kEps, -uni / (ea * ea), zero);
    const Tensor g_uni = 1.0 / ea + at::where(uni >= kEps, -inter / (uc * uc), zero);
    const Tensor g_inter = 1.0 / uc - g_uni;
    // clamp_min(x, 0) passes the gradient where x >= 0 (autograd's convention).
    const Tensor g_w = at::where(w_raw >= 0.0, g_inter * h, zero);
    const Tensor g_h = at::where(h_raw >= 0.0, g_inter * w, zero);
    const Tensor g_ew = g_ea * eh, g_eh = g_ea * ew;
    const Tensor g0 = -g_uni * ph - g_w * win_max(p0, t0) - g_ew * win_min(p0, t0);
    const Tensor g1 = -g_uni * pw - g_h * win_max(p1, t1) - g_eh * win_min(p1, t1);
    const Tensor g2 = g_uni * ph + g_w * win_min(p2, t2) + g_ew * win_max(p2, t2);
    const Tensor g3 = g_uni * pw + g_h * win_min(p3, t3) + g_eh * win_max(p3, t3);
    grad_box = at::where(valid.unsqueeze(1), at::stack({g0, g1, g2, g3}, 1),
                         at::zeros({rows, 4}, dopt));
  }
  // grad_box and scale in the loss dtype, as the CUDA kernels (and the Meta kernel) return them.
  if (grad_box.defined()) grad_box = grad_box.to(giou_loss_dtype(pred));
  // `none` has no scale (the backward multiplies grad_out per box), as on CUDA.
  Tensor scale_t;
  if (reduction != kNone) scale_t = at::scalar_tensor(scale, dopt.dtype(giou_loss_dtype(pred)));
  return {loss, grad_box, scale_t};
}

Tensor giou_bwd_cpu(const Tensor& grad_out, const Tensor& grad_box, const Tensor& scale,
                    int64_t reduction, at::ScalarType pred_dtype, at::IntArrayRef pred_shape) {
  TORCH_CHECK(grad_box.defined() && grad_box.dim() == 2 && grad_box.size(1) == 4,
              "giou_loss_bwd: grad_box must be [rows, 4]");
  TORCH_CHECK(grad_out.device() == grad_box.device(), "giou_loss_bwd: device mismatch");
  const Tensor gb = grad_box.to(at::kDouble);
  Tensor k;
  if (reduction == kNone) {
    TORCH_CHECK(grad_out.numel() == gb.size(0), "giou_loss_bwd: grad_out has ", grad_out.numel(),
                " elements, expected ", gb.size(0));
    k = grad_out.reshape({-1, 1}).to(at::kDouble);
  } else {
    TORCH_CHECK(grad_out.numel() == 1, "giou_loss_bwd: grad_out must be a scalar");
    k = grad_out.reshape({}).to(at::kDouble) * scale.to(at::kDouble);
  }
  return (k * gb).to(pred_dtype).reshape(pred_shape);
}

const c10::TypedOperatorHandle<std::tuple<Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t, int64_t, bool)>&
giou_fwd_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("strobe::giou_loss_fwd", "")
          .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&,
                                                    const std::optional<Tensor>&, int64_t,
                                                    int64_t, bool)>();
  return op;
}

// pred_shape is SymInt[] so torch.compile's dynamic shapes pass through the autograd function.
const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t,
                                      at::ScalarType, c10::SymIntArrayRef)>&
giou_bwd_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::giou_loss_bwd", "")
                             .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t,
                                           at::ScalarType, c10::SymIntArrayRef)>();
  return op;
}

class GiouLossFunction : public torch::autograd::Function<GiouLossFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& pred,
                        const Tensor& target, const std::optional<Tensor>& offsets, int64_t layout,
                        int64_t reduction) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [loss, grad_box, scale] =
        giou_fwd_op().call(pred, target, offsets, layout, reduction, pred.requires_grad());
    ctx->save_for_backward({grad_box, scale});
    ctx->saved_data["reduction"] = reduction;
    ctx->saved_data["pred_dtype"] = static_cast<int64_t>(pred.scalar_type());
    ctx->saved_data["pred_shape"] = pred.sym_sizes().vec();
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["pred_dtype"].toInt());
    const auto shape = ctx->saved_data["pred_shape"].toSymIntVector();
    Tensor grad_out = grad_outputs[0];
    if (!grad_out.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    const Tensor grad_pred = giou_bwd_op().call(grad_out.contiguous(), saved[0], saved[1],
                                           ctx->saved_data["reduction"].toInt(), dtype, shape);
    return {grad_pred, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor giou_autograd(const Tensor& pred, const Tensor& target,
                     const std::optional<Tensor>& offsets, int64_t layout, int64_t reduction) {
  TORCH_CHECK(!target.requires_grad(),
              "giou_loss: target must not require grad (the loss is differentiable in pred only)");
  return GiouLossFunction::apply(pred, target, offsets, layout, reduction);
}

Tensor giou_nograd(const Tensor& pred, const Tensor& target, const std::optional<Tensor>& offsets,
                   int64_t layout, int64_t reduction) {
  return std::get<0>(giou_fwd_op().call(pred, target, offsets, layout, reduction, false));
}

Tensor giou_loss_autograd(const Tensor& pred, const Tensor& target, std::string_view reduction) {
  return giou_autograd(pred, target, std::nullopt, kPadded, detail::parse_reduction(reduction, "giou_loss"));
}
Tensor giou_loss_nograd(const Tensor& pred, const Tensor& target, std::string_view reduction) {
  return giou_nograd(pred, target, std::nullopt, kPadded, detail::parse_reduction(reduction, "giou_loss"));
}
int64_t packed_layout(const Tensor& pred) { return pred.dim() == 3 ? kPackedTargets : kPacked; }
Tensor giou_loss_packed_autograd(const Tensor& pred, const Tensor& target, const Tensor& offsets,
                                 std::string_view reduction) {
  return giou_autograd(pred, target, offsets, packed_layout(pred),
                       detail::parse_reduction(reduction, "giou_loss"));
}
Tensor giou_loss_packed_nograd(const Tensor& pred, const Tensor& target, const Tensor& offsets,
                               std::string_view reduction) {
  return giou_nograd(pred, target, offsets, packed_layout(pred),
                     detail::parse_reduction(reduction, "giou_loss"));
}

}  // namespace

Tensor giou(const Tensor& pred, const Tensor& target, std::string_view reduction) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::giou", "")
                             .typed<Tensor(const Tensor&, const Tensor&, std::string_view)>();
  return op.call(pred, target, reduction);
}

Tensor giou_packed(const Tensor& pred, const Tensor& target, const Tensor& offsets,
                   std::string_view reduction) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("strobe::giou_packed", "")
          .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, std::string_view)>();
  return op.call(pred, target, offsets, reduction);
}

Tensor generalized_box_iou_loss(const Tensor& pred, const Tensor& target,
                                std::string_view reduction) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("strobe::generalized_box_iou_loss", "")
                             .typed<Tensor(const Tensor&, const Tensor&, std::string_view)>();
  return op.call(pred, target, reduction);
}

namespace {
// 1 - GIoU over every pair of [..., 4] boxes: the packed GIoU kernels with one image holding all
// pairs (every packed row is valid), composed in ATen ops so autograd, Meta and torch.compile
// come from giou_packed's own kernels (CompositeImplicitAutograd).
Tensor generalized_box_iou_loss_composite(const Tensor& pred, const Tensor& target,
                                          std::string_view reduction) {
  const int64_t r = detail::parse_reduction(reduction, "giou_loss");
  TORCH_CHECK(pred.dim() >= 1 && pred.size(-1) == 4,
              "generalized_box_iou_loss: pred must be [..., 4], got ", pred.sizes());
  TORCH_CHECK(pred.sym_sizes() == target.sym_sizes(), "generalized_box_iou_loss: pred ", pred.sizes(),
              " and target ", target.sizes(), " must have the same shape");
  const Tensor p = pred.reshape({-1, 4}), t = target.reshape({-1, 4});
  // offsets [0, rows] built on the device (no host-to-device copy); sizes stay symbolic under
  // torch.compile (sym_size, no host ints).
  const Tensor offsets =
      at::mul(at::arange(2, pred.options().dtype(at::kLong)), c10::Scalar(p.sym_size(0)));
  const Tensor rows = offsets.select(0, 1).to(giou_loss_dtype(pred));
  if (r == kNone) {
    return at::rsub(giou_packed(p, t, offsets, "none"), 1.0)
        .reshape_symint(pred.sym_sizes().slice(0, pred.dim() - 1));
  }
  if (r == kSum) return rows - giou_packed(p, t, offsets, "sum");
  // mean = 1 - mean GIoU; over zero pairs 0 (torchvision gives NaN there).
  return at::rsub(giou_packed(p, t, offsets, "mean"), 1.0) * rows.gt(0).to(rows.scalar_type());
}
}  // namespace

namespace detail {
// Used by the CUDA glue for the checks both devices share.
void giou_check_inputs(const Tensor& pred, const Tensor& target,
                       const std::optional<Tensor>& offsets, int64_t layout) {
  check_inputs(pred, target, offsets, layout);
}
}  // namespace detail

}  // namespace strobe::ops

TORCH_LIBRARY_IMPL(strobe, Autograd, m) {
  m.impl("giou", &strobe::ops::giou_loss_autograd);
  m.impl("giou_packed", &strobe::ops::giou_loss_packed_autograd);
}

TORCH_LIBRARY_IMPL(strobe, CompositeImplicitAutograd, m) {
  m.impl("generalized_box_iou_loss", &strobe::ops::generalized_box_iou_loss_composite);
}

TORCH_LIBRARY_IMPL(strobe, CPU, m) {
  m.impl("giou", &strobe::ops::giou_loss_nograd);
  m.impl("giou_packed", &strobe::ops::giou_loss_packed_nograd);
  m.impl("giou_loss_fwd", &strobe::ops::giou_fwd_cpu);
  m.impl("giou_loss_bwd", &strobe::ops::giou_bwd_cpu);
}

TORCH_LIBRARY_IMPL(strobe, CUDA, m) {
  m.impl("giou", &strobe::ops::giou_loss_nograd);
  m.impl("giou_packed", &strobe::ops::giou_loss_packed_nograd);
}
