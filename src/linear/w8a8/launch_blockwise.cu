// W8A8 GEMM launcher, block-wise parameters (blocks of 32, 64 or 128 columns): per-block promotion.
#include "linear/w8a8/launch_impl.cuh"

namespace tessera::linear::w8a8 {
namespace {

template <int kBlock>
void launch_block(const Problem& pb, cudaStream_t stream) {
  switch (pb.config.bn) {
    case 8:
      return launch_kernel<8, kBlock>(pb, stream);
    case 32:
      return launch_kernel<32, kBlock>(pb, stream);
    case 64:
      return launch_kernel<64, kBlock>(pb, stream);
    default:
      return launch_kernel<128, kBlock>(pb, stream);
  }
}

}  // namespace

void launch_blockwise(const Problem& pb, cudaStream_t stream) {
  switch (pb.shape.block) {
    case 32:
      return launch_block<32>(pb, stream);
    case 64:
      return launch_block<64>(pb, stream);
    default:
      return launch_block<128>(pb, stream);
  }
}

}  // namespace tessera::linear::w8a8
