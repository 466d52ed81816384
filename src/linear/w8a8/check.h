// Internal: validation of an Int8BlockTensor, shared by quantize_per_block (its output) and gemm_w8a8 (its operands).
#pragma once

#include <string>

#include "common/validate.h"
#include "tessera/w8a8.h"

namespace tessera::linear::w8a8 {

// The block is 32, 64, 128 or K; K a positive multiple of 16 and of the block.
void check_block(const ::tessera::detail::ArgCheck& check, const char* arg, int64_t block, int64_t k);

// codes int8 [rows, K] (rows < 0: any, taken from codes), unit inner stride, 16-byte aligned rows, on this device;
// scale fp32 [K / block, rows] with row stride ld (a multiple of 4, >= rows) and unit inner stride, 16-byte aligned;
// zero and sums (when given, or when `need_zero` / `need_sums`) the same shape and strides. `name` prefixes the
// argument names ("a" → "a.codes", "a.scale", ...). Returns rows.
int64_t check_int8_blocks(const ::tessera::detail::ArgCheck& check, const Int8BlockTensor& t, const std::string& name,
                          int64_t rows, int64_t k, bool need_sums);

}  // namespace tessera::linear::w8a8
