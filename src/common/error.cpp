#include <cstring>
#include <string>

#include "common/check.h"

namespace tessera::detail {

namespace {
// The path relative to the source tree (src/..., tests/...): a message never carries the build machine's
// directories. TESSERA_SOURCE_ROOT is the tree's absolute path with a trailing slash (set by CMake); a file from
// elsewhere keeps only its name.
const char* source_path(const char* file) {
#ifdef TESSERA_SOURCE_ROOT
  const std::size_t n = std::strlen(TESSERA_SOURCE_ROOT);
  if (std::strncmp(file, TESSERA_SOURCE_ROOT, n) == 0) return file + n;
#endif
  const char* slash = std::strrchr(file, '/');
  return slash != nullptr ? slash + 1 : file;
}
}  // namespace

void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  // Reset the non-sticky error state so the next call does not report this error again.
  (void)cudaGetLastError();
  throw CudaError(std::string("tessera: CUDA error ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                  ") in " + expr + " at " + source_path(file) + ":" + std::to_string(line));
}

}  // namespace tessera::detail
