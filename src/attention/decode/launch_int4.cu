// Decode kernels for the int4 KV format(s), instantiated here so that the formats compile in parallel.
#include "attention/decode/launch.cuh"

namespace tessera::attention::detail {
template void launch_decode_format<KVFormat::kInt4>(const DecodeArgs&, int, cudaStream_t);
template void launch_decode_format<KVFormat::kInt4Group32>(const DecodeArgs&, int, cudaStream_t);
}  // namespace tessera::attention::detail
