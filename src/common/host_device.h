// Internal: TESSERA_HD marks functions that host code and kernels share (layouts, pure index math); plain C++ when
// the file is not compiled by nvcc.
#pragma once

#if defined(__CUDACC__)
#define TESSERA_HD __host__ __device__
#else
#define TESSERA_HD
#endif
