#include <string>

#include "common/check.h"

namespace tessera::detail {

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  // Reset the non-sticky error state so the next call does not report this error again.
  (void)cudaGetLastError();
  throw Error(std::string("tessera: CUDA error ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
              ") in " + expr + " at " + file + ":" + std::to_string(line));
}

}  // namespace tessera::detail
