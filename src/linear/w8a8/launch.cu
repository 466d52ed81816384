// W8A8 GEMM launcher, one block per row (per token / per channel): int32 accumulation over all of K.
#include "linear/w8a8/launch_impl.cuh"

namespace tessera::linear::w8a8 {

void launch_per_row(const Problem& pb, cudaStream_t stream) {
  switch (pb.config.bn) {
    case 8:
      return launch_kernel<8, 0>(pb, stream);
    case 32:
      return launch_kernel<32, 0>(pb, stream);
    case 64:
      return launch_kernel<64, 0>(pb, stream);
    case 128:
      return launch_kernel<128, 0>(pb, stream);
    default:
      return launch_kernel<256, 0>(pb, stream);
  }
}

void launch(const Problem& pb, cudaStream_t stream) {
  if (pb.shape.blockwise())
    launch_blockwise(pb, stream);
  else
    launch_per_row(pb, stream);
}

}  // namespace tessera::linear::w8a8
