// A small worker pool for the quantized products (qgemm.cpp only: it is not
// shared with the ISA translation units, so the inline functions here are
// compiled once, for the baseline target).
//
// Why not OpenMP (at::parallel_for): the engine sets OMP_WAIT_POLICY=PASSIVE
// (radixlm/__init__.py) so that idle OpenMP threads sleep and leave the two
// cores to the server's other processes. Decode-sized products (a few rows)
// take 5-100 us each and a token runs ~120 of them back to back; waking a
// sleeping OpenMP thread for each (a futex round trip, then the scheduler)
// cost more than the second core gained (9.5 ms per token's matmuls on one
// thread, 14-15 ms on two). This pool spins for a bounded time instead, so
// the products of one forward pass hand off through one cache line, and then
// sleeps, so an idle engine burns no core; torch's own OpenMP ops keep the
// engine's passive policy.
//
// A job is `count` chunks of `fn(ctx, chunk)`. The caller publishes it and
// claims chunks itself; a worker claims what is left when it arrives. Chunks
// are claimed one by one (compare-and-swap on one 64-bit word), so a worker
// that is asleep, or whose core another process holds, costs nothing but its
// share: the caller does the rest. Which thread computes a chunk never
// changes its bits (the kernels compute each output the same way whatever
// range of tiles or rows they are given).
//
// The word packs (generation: 24 bits, chunk count: 20, next chunk: 20), so a
// claim succeeds only for a live job's unclaimed chunk: a worker that wakes
// late for an old job sees another generation, or next == count, and claims
// nothing; a job cannot complete while one of its chunks is claimed and not
// done, so the job's fields are stable for whoever holds a claim.
//
// Safety: one caller at a time (qgemm.cpp holds a lock around run(); a
// second Python thread that finds it held runs its product serially on its
// own thread); the kernels do not throw; qgemm.cpp drops the pool in a
// fork()ed child (its threads do not exist there) and makes a new one on
// first use.
#pragma once

#include <immintrin.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace radixlm_q {

class Pool {
 public:
  using Fn = void (*)(const void* ctx, int64_t chunk);
  static constexpr int64_t kMaxChunks = (int64_t{1} << 20) - 1;

  explicit Pool(int workers) {
    for (int i = 0; i < workers; ++i) {
      threads_.emplace_back([this] { work(); });
      pthread_setname_np(threads_.back().native_handle(), "radixlm-qgemm");
    }
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      stop_.store(true, std::memory_order_seq_cst);
    }
    sleep_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  int workers() const { return static_cast<int>(threads_.size()); }

  // How long a worker spins (yielding) for the next job before it sleeps.
  // SmolLM2 decode in the engine (one 512-token prompt, 2 threads, passive
  // OpenMP, 4 interleaved runs, tok/s): one thread 47-58; pool spinning 100 us
  // 62-82, 300 us 71-75, 1000 us 67-81 (median 79). 1 ms bridges most gaps
  // between one token's forward and the next; an idle engine spins it once.
  // The model pass alone (products back to back) is the same from 50 us up,
  // worse at 0-20 us (a wake-up per product).
  static std::atomic<int64_t>& spin_ns() {
    static std::atomic<int64_t> ns{1000000};
    return ns;
  }

  // Runs fn(ctx, c) for c in [0, count) (count <= kMaxChunks) on this thread
  // and the workers; returns when all are done. One caller at a time.
  void run(Fn fn, const void* ctx, int64_t count) {
    fn_ = fn;
    ctx_ = ctx;
    done_.store(0, std::memory_order_relaxed);
    gen_ = (gen_ + 1) & kGenMask;
    // seq_cst: against a worker going to sleep (it raises sleepers_, then
    // reads state_): one of the two sees the other's write.
    state_.store(pack(gen_, count, 0), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> sleep_lock(sleep_mu_); }
      sleep_cv_.notify_all();
    }
    const int64_t mine = claim_all(gen_);
    // The workers' chunks: they started at about the same time as we did.
    spin_until([&] { return done_.load(std::memory_order_acquire) + mine >= count; }, true);
  }

 private:
  static constexpr uint64_t kGenMask = (uint64_t{1} << 24) - 1, kField = (uint64_t{1} << 20) - 1;
  static uint64_t pack(uint64_t gen, int64_t count, int64_t next) {
    return gen << 40 | uint64_t(count) << 20 | uint64_t(next);
  }
  static uint64_t gen_of(uint64_t s) { return s >> 40; }

  // Claims and runs chunks of job `gen` until none is left; returns how many.
  int64_t claim_all(uint64_t gen) {
    int64_t ran = 0;
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      const int64_t count = (s >> 20) & kField, next = s & kField;
      if (gen_of(s) != gen || next >= count) return ran;
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire))
        continue;
      fn_(ctx_, next);
      ++ran;
      s = state_.load(std::memory_order_acquire);
    }
  }

  // Spins until pred(): 8 pauses, then sched_yield, so that a thread woken
  // on this core (torch's OpenMP threads, the server's processes) runs at
  // once instead of waiting for the scheduler to preempt a spinner. Measured
  // where it matters most, OpenMP spinning too (its default wait policy, not
  // the engine's): without the yields a 1 ms spin made the engine's decode
  // attention (OpenMP, 2 threads) 7x slower, 47 -> 350 us a call, and decode
  // 32-36 tok/s against 53-56 with them. Under the passive policy, and on
  // the model pass, yielding every 8, 64 or no pauses measured the same.
  // Past spin_ns(): returns false, or keeps checking when `yield`.
  template <typename Pred>
  static bool spin_until(Pred pred, bool yield) {
    using clock = std::chrono::steady_clock;
    if (pred()) return true;
    const auto limit = clock::now() + std::chrono::nanoseconds(spin_ns().load());
    for (;;) {
      for (int i = 0; i < 8; ++i) {
        _mm_pause();
        if (pred()) return true;
      }
      std::this_thread::yield();
      if (!yield && clock::now() > limit) return false;
    }
  }

  void work() {
    uint64_t seen = gen_of(state_.load(std::memory_order_acquire));
    for (;;) {
      const auto fresh = [&] { return gen_of(state_.load(std::memory_order_acquire)) != seen; };
      if (!spin_until(fresh, false)) {
        std::unique_lock<std::mutex> lock(sleep_mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        sleep_cv_.wait(lock, [&] {
          return stop_.load(std::memory_order_seq_cst) ||
                 gen_of(state_.load(std::memory_order_seq_cst)) != seen;
        });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      if (stop_.load(std::memory_order_acquire)) return;
      seen = gen_of(state_.load(std::memory_order_acquire));
      const int64_t ran = claim_all(seen);
      if (ran) done_.fetch_add(ran, std::memory_order_release);
    }
  }

  uint64_t gen_ = 0;  // the caller's
  // The job: written before state_ publishes it, read only by a thread that
  // holds a claim on it (so never while the next job's caller writes them).
  Fn fn_ = nullptr;
  const void* ctx_ = nullptr;
  alignas(64) std::atomic<uint64_t> state_{0};
  alignas(64) std::atomic<int64_t> done_{0};  // chunks the workers finished
  alignas(64) std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex sleep_mu_;
  std::condition_variable sleep_cv_;
  std::vector<std::thread> threads_;
};

}  // namespace radixlm_q
