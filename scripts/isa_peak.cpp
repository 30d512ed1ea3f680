// The CPU's arithmetic roofs for the kernels' three kinds of products: fp32 multiply-adds (vfmadd231ps), bf16 pairs
// (vdpbf16ps) and int8 quads (vpdpbusd), each a loop of 12 independent sums on every thread at once, in operations a
// second (a multiply-add is two). The kernels' GOP/s (python -m tokenmill.bench.matmul) read against these.
//   g++ -O2 -march=native -pthread scripts/isa_peak.cpp -o /tmp/isa_peak && /tmp/isa_peak [threads]
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

constexpr int kSums = 12;
constexpr long kIterations = 50'000'000;

// ops a second of kIterations x kSums calls of step(sum, a, b), ops_per_call each.
template <typename V, typename Step>
double rate(V a, V b, double ops_per_call, Step step) {
  V sums[kSums];
  for (int k = 0; k < kSums; ++k) sums[k] = a;
  const auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < kIterations; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < kSums; ++k) sums[k] = step(sums[k], a, b);
    asm volatile("" : "+v"(a));  // a is unknown to the compiler each iteration: the loop is not folded
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int k = 0; k < kSums; ++k) asm volatile("" : : "v"(sums[k]));
  return kIterations * kSums * ops_per_call / seconds;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : static_cast<int>(std::thread::hardware_concurrency());
  const char* names[] = {"fp32 multiply-adds (vfmadd231ps)", "bf16 pairs (vdpbf16ps)", "int8 quads (vpdpbusd)"};
  for (int kind = 0; kind < 3; ++kind) {
    std::vector<double> rates(threads);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        if (kind == 0) {
#if defined(__AVX512F__)
          rates[t] = rate(_mm512_set1_ps(1.f), _mm512_set1_ps(1.f), 32,
                          [](__m512 s, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, s); });
#else  // AVX2
          rates[t] = rate(_mm256_set1_ps(1.f), _mm256_set1_ps(1.f), 16,
                          [](__m256 s, __m256 a, __m256 b) { return _mm256_fmadd_ps(a, b, s); });
#endif
        } else if (kind == 1) {
#if defined(__AVX512BF16__)
          rates[t] = rate(_mm512_set1_ps(1.f), _mm512_set1_ps(1.f), 64, [](__m512 s, __m512 a, __m512 b) {
            return _mm512_dpbf16_ps(s, (__m512bh)_mm512_castps_si512(a), (__m512bh)_mm512_castps_si512(b));
          });
#endif
        } else {
#if defined(__AVX512VNNI__)
          rates[t] = rate(_mm512_set1_epi8(1), _mm512_set1_epi8(1), 128,
                          [](__m512i s, __m512i a, __m512i b) { return _mm512_dpbusd_epi32(s, a, b); });
#endif
        }
      });
    for (auto& thread : pool) thread.join();
    double total = 0;
    for (double r : rates) total += r;
    if (total > 0) std::printf("%-34s %7.0f GOP/s on %d threads\n", names[kind], total / 1e9, threads);
    else std::printf("%-34s not built (no such instructions)\n", names[kind]);
  }
}
