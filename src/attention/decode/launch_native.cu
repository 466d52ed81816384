// Decode kernels for the native KV format(s), instantiated here so that the formats compile in parallel.
#include "attention/decode/launch.cuh"

namespace tessera::attention::detail {
template void launch_decode_format<KVFormat::kNative>(const DecodeArgs&, int, cudaStream_t);
}  // namespace tessera::attention::detail
