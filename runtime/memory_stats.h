// Memory statistics in the style of c10's Stat: current and peak level, and cumulative
// amounts allocated and freed.
#pragma once

#include <algorithm>
#include <cstdint>

namespace ps {

struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;  // cumulative
  int64_t freed = 0;      // cumulative

  void Increase(int64_t amount) {
    current += amount;
    allocated += amount;
    peak = std::max(peak, current);
  }
  void Decrease(int64_t amount) {
    current -= amount;
    freed += amount;
  }
  void ResetPeak() { peak = current; }
};

struct TierStats {
  Stat bytes;                  // capacity of blocks handed out
  Stat blocks;                 // number of blocks handed out
  int64_t reserved_bytes = 0;  // held from the backing store (slabs); >= bytes.current
  int64_t peak_reserved_bytes = 0;
  int64_t budget_bytes = 0;
  int64_t slabs = 0;
};

}  // namespace ps
