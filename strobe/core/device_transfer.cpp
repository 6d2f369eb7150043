#include "strobe/core/device_transfer.h"

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace strobe {

Batch BatchTransfer::operator()(const torch::Device& device, const std::function<Batch()>& transfer) {
  if (!device.is_cuda()) return transfer();
  // Device-generic c10 interfaces: strobe_core includes no CUDA header.
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  const c10::Device dev = device.has_index() ? device : impl.getDevice();
  if (!stream_ || stream_->device() != dev) stream_ = impl.getStreamFromGlobalPool(dev, /*isHighPriority=*/false);
  const c10::Stream compute = impl.getStream(dev);
  Batch out;
  c10::Event copied(c10::DeviceType::CUDA);
  {
    c10::StreamGuard on_copy_stream(*stream_);
    out = transfer();
    copied.record(*stream_);
  }
  copied.block(compute);
  for (const auto& kv : out.tensors) {
    const auto& t = kv.second;
    if (t.defined() && t.is_cuda() && t.has_storage()) impl.recordDataPtrOnStream(t.storage().data_ptr(), compute);
  }
  return out;
}

}  // namespace strobe
