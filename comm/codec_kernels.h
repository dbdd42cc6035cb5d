// The codecs' element loops: fp32 <-> bf16 and fp16, int8 block quantisation, fp32 accumulation. Internal to
// comm/ (codec.cc is the only caller); the public switches are CodecIsa() and ForceScalarCodecs() in codec.h.
//
//   const internal::Kernels* k = internal::CodecKernels();
//   k->f32_to_bf16(input, output, n);
//
// Each loop is written once as a plain loop and compiled three times (AVX-512, AVX2+F16C, baseline x86-64);
// the best set this CPU supports is picked at start-up (codec_kernels.cc). Every set gives the same bits
// (the file is compiled without FMA contraction), so a scalar sender and an AVX-512 receiver agree.
// Thread safety: the kernels are pure functions; CodecKernels() may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>

namespace geotrain::comm::internal {

// One instruction set's loops. int8_encode writes ceil(n / kInt8BlockSize) scales and n values and returns
// false on NaN or infinity; int8_decode decodes elements [begin, begin + n) (begin a multiple of the block).
struct Kernels {
  const char* name;
  void (*f32_to_bf16)(const float*, uint16_t*, size_t);
  void (*bf16_to_f32)(const uint16_t*, float*, size_t);
  void (*f32_to_f16)(const float*, uint16_t*, size_t);
  void (*f16_to_f32)(const uint16_t*, float*, size_t);
  bool (*int8_encode)(const float*, size_t, float*, int8_t*);
  void (*int8_decode)(const int8_t*, const float*, float*, size_t, size_t);
  void (*add_f32)(const float*, float*, size_t);
};

// The set in use: the detected one, or the scalar one after ForceScalarCodecs(true).
const Kernels* CodecKernels();

}  // namespace geotrain::comm::internal
