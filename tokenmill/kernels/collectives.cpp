// Collectives between the tensor-parallel ranks of one host, through a shared-memory segment (tokenmill/parallel/
// collectives.py maps it): a decode-sized all-reduce through gloo's sockets costs hundreds of microseconds, through
// shared memory a few.
//
// The segment holds a flag line (64 bytes) per rank and one for an abort code, then two buffers of a slot per rank.
// Every collective is one exchange of generation g: each rank writes its slot of buffer g % 2, publishes g in its
// flag (a release store) and waits until every flag reads g or more (acquire loads); then it reads the slots it
// needs. A rank writes buffer g % 2 again only at g + 2, after every rank published g + 1, that is after every rank
// finished reading generation g: two buffers and one wait a collective are enough.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sched.h>
#include <time.h>

#include <chrono>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tokenmill {

namespace {

constexpr int64_t kLine = 8;  // int64 flags a cache line: each rank's flag on its own line

inline int64_t* flag_of(const at::Tensor& flags, int64_t index) { return flags.data_ptr<int64_t>() + index * kLine; }

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Wait until every rank's flag reads generation or more. Spins for the first few milliseconds (ranks in one step
// meet within microseconds; past the first rounds it yields the core, for ranks that outnumber the cores), then
// sleeps in short naps (an idle worker waiting for the next step). Returns false
// after timeout_s (< 0: never); throws if the abort code is set (a rank died: parallel/collectives.py names it).
bool wait_all(const at::Tensor& flags, int64_t world, int64_t generation, double timeout_s) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  constexpr auto kSpin = std::chrono::milliseconds(5);
  int64_t* abort = flag_of(flags, 0);
  for (int64_t r = 0; r < world; ++r) {
    int64_t* flag = flag_of(flags, 1 + r);
    for (uint64_t round = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) < generation; ++round) {
      const int64_t code = __atomic_load_n(abort, __ATOMIC_ACQUIRE);
      TORCH_CHECK(code == 0, "tensor-parallel group aborted: rank ", code - 1, " is gone");
      if (round % 256 != 255) {
        relax();
        continue;
      }
      const auto waited = clock::now() - start;
      if (timeout_s >= 0 && std::chrono::duration<double>(waited).count() > timeout_s) return false;
      if (waited > kSpin) {
        timespec nap{0, 50000};
        nanosleep(&nap, nullptr);
      } else if (round > 4096) {
        sched_yield();  // more ranks than cores: let the one we wait for run
      }
    }
  }
  return true;
}

template <typename T>
inline float as_float(T v) { return static_cast<float>(v); }

// x = the sum of every rank's slot, added in rank order so that every rank gets the same bits; fp32 sums of 16-bit
// values, rounded once.
template <typename T>
void sum_slots(T* x, const uint8_t* buffer, int64_t slot_bytes, int64_t world, int64_t n) {
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float acc = as_float(reinterpret_cast<const T*>(buffer)[i]);
      for (int64_t r = 1; r < world; ++r) acc += as_float(reinterpret_cast<const T*>(buffer + r * slot_bytes)[i]);
      x[i] = static_cast<T>(acc);
    }
  });
}

}  // namespace

// Publish this rank's generation and wait for every other's (the data is written and read by the caller).
bool shm_exchange(const at::Tensor& flags, int64_t rank, int64_t world, int64_t generation, double timeout_s) {
  TORCH_CHECK(flags.scalar_type() == at::kLong && flags.is_contiguous(), "shm_exchange: int64 flags");
  TORCH_CHECK(flags.numel() >= (1 + world) * kLine && 0 <= rank && rank < world, "shm_exchange: flags too small");
  __atomic_store_n(flag_of(flags, 1 + rank), generation, __ATOMIC_RELEASE);
  return wait_all(flags, world, generation, timeout_s);
}

// numel values of `type` at data (in place) = their sum over the ranks, through slots [2, world, slot bytes] of
// the shared segment, as exchange `generation`; the fused decode layer (layer.cpp) calls it on its scratch rows.
void all_reduce_values(void* data, at::ScalarType type, int64_t numel, const at::Tensor& slots,
                       const at::Tensor& flags, int64_t rank, int64_t world, int64_t generation, double timeout_s) {
  TORCH_CHECK(slots.is_contiguous() && slots.dim() == 3 && slots.size(1) == world,
              "tensor-parallel all-reduce: slots [2, world, bytes]");
  const int64_t slot_bytes = slots.size(2);
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(type));
  TORCH_CHECK(bytes <= slot_bytes, "tensor-parallel all-reduce: ", bytes, " bytes, over a slot's ", slot_bytes);
  uint8_t* buffer = slots.data_ptr<uint8_t>() + (generation % 2) * world * slot_bytes;
  std::memcpy(buffer + rank * slot_bytes, data, bytes);
  TORCH_CHECK(shm_exchange(flags, rank, world, generation, timeout_s), "tensor-parallel all-reduce: a rank did not "
              "answer in ", timeout_s, " s");
  switch (type) {
    case at::kFloat: sum_slots(static_cast<float*>(data), buffer, slot_bytes, world, numel); break;
    case at::kBFloat16: sum_slots(static_cast<at::BFloat16*>(data), buffer, slot_bytes, world, numel); break;
    case at::kHalf: sum_slots(static_cast<at::Half*>(data), buffer, slot_bytes, world, numel); break;
    default: TORCH_CHECK(false, "tensor-parallel all-reduce: fp32, bf16 or fp16, not ", type);
  }
}

// x (in place) = the sum of x over the ranks.
void shm_all_reduce(at::Tensor& x, const at::Tensor& slots, const at::Tensor& flags, int64_t rank, int64_t world,
                    int64_t generation, double timeout_s) {
  TORCH_CHECK(x.is_contiguous(), "shm_all_reduce: a contiguous x");
  all_reduce_values(x.data_ptr(), x.scalar_type(), x.numel(), slots, flags, rank, world, generation, timeout_s);
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("shm_exchange(Tensor flags, int rank, int world, int generation, float timeout_s) -> bool");
  m.def("shm_all_reduce(Tensor(a!) x, Tensor slots, Tensor flags, int rank, int world, int generation, "
        "float timeout_s) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("shm_exchange", &tokenmill::shm_exchange);
  m.impl("shm_all_reduce", &tokenmill::shm_all_reduce);
}
