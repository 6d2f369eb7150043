#include "strobe/logging/device_readback.h"

#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/torch.h>

namespace strobe {

DeviceReadback::DeviceReadback() = default;
DeviceReadback::~DeviceReadback() = default;
DeviceReadback::DeviceReadback(DeviceReadback&&) noexcept = default;
DeviceReadback& DeviceReadback::operator=(DeviceReadback&&) noexcept = default;

void DeviceReadback::start(const torch::Tensor& value) {
  const bool cuda = value.is_cuda();
  const int64_t n = value.numel();
  if (!buffer_.defined() || buffer_.numel() < n || buffer_.scalar_type() != value.scalar_type() || pinned_ != cuda) {
    // Room to grow: a ring reallocates rarely. Zeroed, not empty: the view handed out before the copy
    // lands must not hold stale bits (replay's tracer checks every op's output, this narrow's too).
    buffer_ = torch::zeros({std::max<int64_t>(n, 32)}, torch::TensorOptions().dtype(value.scalar_type()).pinned_memory(cuda));
    pinned_ = cuda;
  }
  host_ = buffer_.narrow(0, 0, n).view(value.sizes());
  host_.copy_(value, /*non_blocking=*/cuda);
  if (cuda) {
    if (!event_) event_ = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    event_->record(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(value.device()));
  } else {
    event_.reset();
  }
}

bool DeviceReadback::ready() const { return !event_ || event_->query(); }

const torch::Tensor& DeviceReadback::wait() {
  if (event_) event_->synchronize();
  return host_;
}

}  // namespace strobe
