// tessera — umbrella header.
#pragma once

#include "tessera/attention.h"
#include "tessera/conv.h"
#include "tessera/error.h"
#include "tessera/grouped_gemm.h"
#include "tessera/linear.h"
#include "tessera/w8a8.h"
#include "tessera/moe.h"
#include "tessera/tensor.h"
#include "tessera/version.h"
