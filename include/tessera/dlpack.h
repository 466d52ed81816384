// tessera — DLPack interop (public). Needs the DLPack header on the include path: <dlpack/dlpack.h> (Debian's
// libdlpack-dev) or the copy PyTorch ships as <ATen/dlpack.h>.
#pragma once

#if __has_include(<dlpack/dlpack.h>)
#include <dlpack/dlpack.h>
#else
#include <ATen/dlpack.h>
#endif

#include "tessera/tensor.h"

namespace tessera {

// Views a DLTensor as a TensorView. Throws tessera::Error naming `arg` for element types tessera does not
// have, for devices other than CUDA / CUDA-host / CPU, or for rank > TensorView::kMaxRank. A DLTensor without
// strides is contiguous. The byte offset is folded into the data pointer.
TensorView from_dlpack(const DLTensor& t, const char* arg = "tensor");

}  // namespace tessera
