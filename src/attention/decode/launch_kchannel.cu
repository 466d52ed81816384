// Decode kernels for the per-channel key formats (int8 / int4 keys with per-channel scales over 32-token blocks),
// instantiated here so that the formats compile in parallel.
#include "attention/decode/launch.cuh"

namespace tessera::attention::detail {
template void launch_decode_format<KVFormat::kInt8KChannel>(const DecodeArgs&, int, cudaStream_t);
template void launch_decode_format<KVFormat::kInt4KChannel>(const DecodeArgs&, int, cudaStream_t);
}  // namespace tessera::attention::detail
