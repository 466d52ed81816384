// tessera — DLPack interop (public). Needs <dlpack/dlpack.h> on the include path (Debian's libdlpack-dev, or the
// copy that PyTorch ships).
#pragma once

#include <dlpack/dlpack.h>

#include "tessera/tensor.h"

namespace tessera {

// Views a DLTensor as a TensorView. Throws tessera::Error naming `arg` for element types tessera does not
// have, for devices other than CUDA / CUDA-host / CPU, or for rank > TensorView::kMaxRank. A DLTensor without
// strides is contiguous. The byte offset is folded into the data pointer.
TensorView from_dlpack(const DLTensor& t, const char* arg = "tensor");

}  // namespace tessera
