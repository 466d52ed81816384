// tessera — umbrella header.
#pragma once

#include "tessera/attention.h"
#include "tessera/error.h"
#include "tessera/grouped_gemm.h"
#include "tessera/moe.h"
#include "tessera/tensor.h"
#include "tessera/version.h"
