// Small helpers every benchmark uses: the median of samples, and the machine's load average, printed
// beside the figures because the benchmark machines are shared and contention changes results a lot.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace geotrain::bench {

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The first field of /proc/loadavg, or "?".
inline std::string LoadAverage() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return "?";
  char buffer[64] = {0};
  const size_t got = std::fread(buffer, 1, sizeof(buffer) - 1, f);
  std::fclose(f);
  std::string s(buffer, got);
  return s.substr(0, s.find(' '));
}

}  // namespace geotrain::bench
