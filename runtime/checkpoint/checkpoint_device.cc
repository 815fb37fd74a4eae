// PackedCheckpoint::GetDevice, in a file of its own so that programs which only read or pack
// checkpoints do not pull in the GPU launch path.
#include "gemvz/checkpoint.h"
#include "runtime/common/status_macros.h"

namespace gemvz {

absl::StatusOr<DeviceMatrix> PackedCheckpoint::GetDevice(const std::string& name, int device,
                                                         const UploadOptions& options) const {
  ASSIGN_OR_RETURN(const PackedMatrix packed, GetPacked(name));
  return DeviceMatrix::Upload(packed, device, options);
}

}  // namespace gemvz
