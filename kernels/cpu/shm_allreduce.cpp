// A sum across the tensor-parallel ranks of one host through shared memory, where gloo's
// all-reduce (loopback TCP, thread hand-offs) takes about a millisecond whatever the size.
//
// The segment: per rank a 64-byte header line (its sequence number and its pid), then two
// banks (alternating by sequence parity) of one slot per rank. An all-reduce number `seq`:
// copy the input into this rank's slot of bank seq & 1, publish `seq` (release), wait until
// every rank has published `seq` (acquire), then sum the slots in rank order, so every
// rank gets the same bits. Two banks make one wait per call enough: a rank writes bank p
// again only at seq + 2, after every rank has published seq + 1, which each does only once
// it has finished reading seq's slots.
//
// Waiting spins with a pause, yielding the core every few thousand spins (two-core
// machines run more ranks than cores); every ~millisecond of waiting it looks for a late
// rank in /proc: one that has exited (or is a zombie) ends the call with -2, and past
// `timeout_s` the call ends with -1, so a dead or hung rank never wedges its peers.

#include <sched.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

struct alignas(64) Header {
  std::atomic<int64_t> seq;
  int64_t pid;
};

// Whether process `pid` has ended: gone from /proc, or a zombie waiting to be reaped.
bool ended(int64_t pid) {
  if (pid <= 0) return false;  // not attached yet
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%lld/stat", static_cast<long long>(pid));
  std::FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;
  char line[512];
  size_t n = std::fread(line, 1, sizeof line - 1, f);
  std::fclose(f);
  line[n] = '\0';
  const char* close = std::strrchr(line, ')');  // the state follows the command's ")"
  return close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

}  // namespace

// Bytes of a segment for `nranks` ranks whose slots hold `capacity` bytes each.
extern "C" int64_t lamina_shm_allreduce_bytes(int64_t nranks, int64_t capacity) {
  return nranks * static_cast<int64_t>(sizeof(Header)) + 2 * nranks * capacity;
}

// Record this rank's pid in its header (its peers watch it while they wait).
extern "C" void lamina_shm_allreduce_attach(char* segment, int64_t rank, int64_t pid) {
  reinterpret_cast<Header*>(segment)[rank].pid = pid;
}

// Sum `numel` elements of `data` (dtype 0: fp32, 1: bf16) across the ranks, in place.
// Returns 0; -1 past `timeout_s`; -2 - r when rank r has ended.
extern "C" int lamina_shm_allreduce(char* segment, int64_t rank, int64_t nranks,
                                    int64_t capacity, void* data, int64_t numel, int dtype,
                                    int64_t seq, double timeout_s) {
  auto* headers = reinterpret_cast<Header*>(segment);
  char* bank = segment + nranks * sizeof(Header) + (seq & 1) * nranks * capacity;
  const int64_t bytes = numel * (dtype == 0 ? 4 : 2);
  std::memcpy(bank + rank * capacity, data, bytes);
  headers[rank].seq.store(seq, std::memory_order_release);

  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < nranks; ++r) {
    for (uint64_t spins = 1; headers[r].seq.load(std::memory_order_acquire) < seq; ++spins) {
      relax();
      if ((spins & 0xfff) == 0) sched_yield();
      if ((spins & 0xffff) == 0) {
        if (ended(headers[r].pid)) return static_cast<int>(-2 - r);
        std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
        if (waited.count() > timeout_s) return -1;
      }
    }
  }

  if (dtype == 0) {
    auto* out = static_cast<float*>(data);
    const auto* first = reinterpret_cast<const float*>(bank);
    for (int64_t i = 0; i < numel; ++i) out[i] = first[i];
    for (int64_t r = 1; r < nranks; ++r) {
      const auto* slot = reinterpret_cast<const float*>(bank + r * capacity);
#pragma omp simd
      for (int64_t i = 0; i < numel; ++i) out[i] += slot[i];
    }
  } else {
    auto* out = static_cast<uint16_t*>(data);
    for (int64_t i = 0; i < numel; ++i) {
      float sum = 0.0f;
      for (int64_t r = 0; r < nranks; ++r) {
        sum += bf16_to_float(reinterpret_cast<const uint16_t*>(bank + r * capacity)[i]);
      }
      out[i] = float_to_bf16(sum);
    }
  }
  return 0;
}
