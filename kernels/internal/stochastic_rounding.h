// Internal: the counter-based random bits of stochastic rounding (Note [Stochastic rounding] in
// kernels/adam.cc), shared by the CPU paths, the CUDA kernel (constexpr, so device code may call
// it under --expt-relaxed-constexpr) and the tests' references.
#pragma once

#include <cstdint>

namespace ps::kernels::internal {

// lowbias32 from Chris Wellons' hash prospector: a bijective 32-bit mixer with low bias.
constexpr uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The key of one chunk's update at one step.
constexpr uint32_t RoundingKey(uint64_t seed, int64_t step) {
  const uint32_t s = Mix32(Mix32(static_cast<uint32_t>(seed)) ^ static_cast<uint32_t>(seed >> 32));
  return Mix32(s ^ static_cast<uint32_t>(step));
}

// The 16 random bits of element `index` (its low 32 bits) under `key`.
constexpr uint32_t RoundingBits(uint32_t key, uint32_t index) { return Mix32(key ^ index) >> 16; }

// x rounded to bf16 (as float) by adding the random bits below bf16's last place and
// truncating: up with probability (dropped bits) / 2^16, so E[result] = x. NaN rounds to
// nearest (as the stores do) so that a payload cannot carry into the exponent.
inline float StochasticBf16(float x, uint32_t random16) {
  uint32_t bits;
  __builtin_memcpy(&bits, &x, 4);
  if (x != x) {
    bits = (bits | 0x400000u) & 0xffff0000u;
  } else {
    bits = (bits + random16) & 0xffff0000u;
  }
  float out;
  __builtin_memcpy(&out, &bits, 4);
  return out;
}

}  // namespace ps::kernels::internal
