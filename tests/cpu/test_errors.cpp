// The error tiers as a caller sees them: CUDA and device failures are tessera::CudaError (a tessera::Error), their
// messages carry no directory of the build machine, and an op on a device that is not sm_90 is refused by name.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <string>

#include "common/check.h"
#include "common/device_info.h"
#include "tessera/error.h"

namespace tessera {
namespace {

TEST(Errors, CudaErrorsAreCudaErrorsWithRepositoryRelativePaths) {
  try {
    TESSERA_CUDA_CHECK(cudaErrorInvalidValue);
    FAIL() << "no throw";
  } catch (const CudaError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cudaErrorInvalidValue"), std::string::npos) << msg;
    EXPECT_NE(msg.find("at tests/cpu/test_errors.cpp:"), std::string::npos) << msg;
    EXPECT_EQ(msg.find(TESSERA_TEST_SOURCE_DIR), std::string::npos) << "build path leaked: " << msg;
  }
}

TEST(Errors, RequireHopperNamesTheOpAndTheDevice) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    (void)cudaGetLastError();
    // No GPU: a CudaError (not an argument error), naming no build directory.
    try {
      detail::require_hopper("tessera::test::op");
      FAIL() << "no throw without a GPU";
    } catch (const CudaError& e) {
      EXPECT_EQ(std::string(e.what()).find(TESSERA_TEST_SOURCE_DIR), std::string::npos) << e.what();
    }
    return;
  }
  int major = 0, minor = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
  if (major == 9 && minor == 0) {
    EXPECT_NO_THROW(detail::require_hopper("tessera::test::op"));
  } else {
    try {
      detail::require_hopper("tessera::test::op");
      FAIL() << "sm_" << major << minor << " accepted";
    } catch (const CudaError& e) {
      const std::string want = "tessera::test::op: needs an sm_90 (Hopper) GPU, found sm_" +
                               std::to_string(major) + std::to_string(minor);
      EXPECT_EQ(std::string(e.what()).rfind(want, 0), 0u) << e.what();
    }
  }
}

// The current device is asked once per op call (OpCallScope, opened by every ArgCheck) and forgotten when the
// outermost scope ends, also when it ends by an exception; outside a call nothing is remembered. Without a GPU the
// question fails each time as a CudaError and no answer is kept.
TEST(Errors, OpCallScopeRemembersTheDeviceForOneCallOnly) {
  using detail::current_device;
  using detail::OpCallScope;
  using detail::remembered_call_device;
  int devices = 0;
  const bool gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  (void)cudaGetLastError();
  ASSERT_EQ(remembered_call_device(), -1);
  if (!gpu) {
    OpCallScope call;
    EXPECT_THROW(current_device(), CudaError);
    EXPECT_EQ(remembered_call_device(), -1);
    EXPECT_THROW(current_device(), CudaError);
    return;
  }
  int expected = -1;
  ASSERT_EQ(cudaGetDevice(&expected), cudaSuccess);
  EXPECT_EQ(current_device(), expected);
  EXPECT_EQ(remembered_call_device(), -1) << "remembered outside any call";
  {
    OpCallScope outer;
    EXPECT_EQ(remembered_call_device(), -1);
    EXPECT_EQ(current_device(), expected);
    EXPECT_EQ(remembered_call_device(), expected);
    {
      OpCallScope nested;  // a step of a layer op: same call, same answer
      EXPECT_EQ(remembered_call_device(), expected);
    }
    EXPECT_EQ(remembered_call_device(), expected) << "a nested scope's end forgot the outer call's device";
  }
  EXPECT_EQ(remembered_call_device(), -1) << "kept past the call";
  try {
    OpCallScope call;
    (void)current_device();
    throw Error("an argument error");
  } catch (const Error&) {
  }
  EXPECT_EQ(remembered_call_device(), -1) << "kept past a call that ended by an exception";
}

}  // namespace
}  // namespace tessera
