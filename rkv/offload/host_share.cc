// rkv host share: a hybrid layer's CPU share started and awaited from inside XLA programs.
//
// Why (docs/DESIGN.md §6, "the layer chain"): in the Python path a hybrid layer's CPU share runs
// in a Python worker thread, which must take the GIL to start, to bring the query down
// (np.asarray, queued on PJRT's host threads) and to set the kernel up; at 2M int8 on the H200
// that was ~2 ms of a 5.5 ms layer before the kernel ran. Here one C++ thread (the runner) runs
// every share's kernel and never takes the GIL, driven by two XLA FFI custom calls:
//
//   rkv_share_start(q f32[B,T,H,D], q_pos s32[B,T]) -> token s32[]   where q is made
//   rkv_share_wait(token) -> (o f32[B,T,H,D], lse f32[B,T,H])         where the partial merges
//
// The token carries no value the caller may read (0 on the CPU, unwritten on CUDA); it orders the
// wait after its start, also when both sit in one program.
//
// On the CPU platform start copies q and q_pos into the share's host buffers and wakes the
// worker; wait blocks until the worker's kernel is done and copies (o, lse) out. On CUDA (the
// handlers run when the program is launched, in stream order on the host) start enqueues the
// two device-to-host copies on the program's stream, then a host function (cuLaunchHostFunc)
// that wakes the worker once the copies are done, so the kernel starts when the GPU has made q,
// with no host thread in between; wait blocks the launching thread until the kernel is done,
// then enqueues the host-to-device copies of (o, lse) into its outputs. The share's buffers are
// pinned host memory the caller owns (jax arrays of memory kind pinned_host), so the copies are
// asynchronous DMA. The CUDA driver is opened with dlopen: no CUDA headers or libraries at build.
//
// Protocol: per share, starts and waits alternate (start, wait, start, wait...): a layer's start
// is in one program and its wait in the next one the host dispatches, and the next start only
// in the next step. A wait pairs with the oldest start not yet awaited; a wait with no start
// pending fails after RKV_SHARE_WAIT_S seconds (an error, never a hang). The kernel's arguments
// (tile pointers, shapes, the options) are the caller's rkv_attn_args, whose q / q_pos pointers
// name the share's buffers; the caller changes them (rkv_share_configure) only between a wait
// and the next start.
//
// Built by rkv/offload/share_build.py with the system C++ compiler against jaxlib's FFI headers.
// The CUDA handlers pass their GPU tests on the H200 (session 19); no faster there than the
// Python worker until session 20 put the layer's tiles before it, then ahead of the worker at the
// same split (session 24), and the default on a GPU (docs/DESIGN.md §6).

#include <dlfcn.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr double kDefaultWaitSeconds = 120.0;  // a wait with no start fails after this

// rkv_cpu_attention(const rkv_attn_args*, int num_threads, int64_t chunk, float* o, float* lse)
using KernelFn = int (*)(const void*, int, int64_t, float*, float*);

struct Share {
  KernelFn kernel = nullptr;
  const void* args = nullptr;  // the caller's rkv_attn_args (q, q_pos: the buffers below)
  int num_threads = 0;
  int64_t chunk = 0;
  float* q = nullptr;  // host (pinned) buffers, owned by the caller
  int32_t* q_pos = nullptr;
  float* o = nullptr;
  float* lse = nullptr;
  size_t q_bytes = 0, q_pos_bytes = 0, o_elems = 0, lse_elems = 0;

  std::mutex mu;
  std::condition_variable cv;
  uint64_t started = 0;   // starts launched
  uint64_t done = 0;      // kernel runs finished
  uint64_t awaited = 0;   // waits served
  int last_rc = 0;        // the last kernel run's return code
  double wait_seconds = kDefaultWaitSeconds;

  // The runner's call: one kernel run over the share's buffers.
  void RunOnce() {
    // A row that sees no key is o = 0, lse = -inf: set before the call like the Python path.
    std::memset(o, 0, o_elems * sizeof(float));
    for (size_t i = 0; i < lse_elems; ++i) lse[i] = -std::numeric_limits<float>::infinity();
    int rc = kernel ? kernel(args, num_threads, chunk, o, lse) : -3;
    {
      std::lock_guard<std::mutex> lock(mu);
      ++done;
      last_rc = rc;
    }
    cv.notify_all();
  }

  void MarkReady();

  // Blocks until the oldest start not yet awaited has run; its return code, or an error string.
  ffi::Error AwaitOne() {
    std::unique_lock<std::mutex> lock(mu);
    const uint64_t target = awaited + 1;
    const bool ok = cv.wait_for(lock, std::chrono::duration<double>(wait_seconds),
                                [&] { return done >= target; });
    if (!ok) {
      return ffi::Error::Internal(
          "rkv_share_wait: no CPU share finished within " + std::to_string(wait_seconds) +
          " s (starts " + std::to_string(started) + ", waits " + std::to_string(awaited) +
          "): a wait needs the share's start in an earlier program");
    }
    awaited = target;
    if (last_rc != 0) {
      return ffi::Error::Internal("rkv_share_wait: the CPU kernel failed (rc=" +
                                  std::to_string(last_rc) +
                                  (last_rc == -1 ? ": out of memory)" : ": bad arguments)"));
    }
    return ffi::Error::Success();
  }
};

// One thread runs every share's kernel, in the order their queries land: the layers' shares run
// one after another anyway, and one calling thread keeps one OpenMP team for the kernel (a
// thread a share would give the process a team of kernel threads per layer).
class Runner {
 public:
  static Runner& Get() {
    static Runner* runner = new Runner();  // never destroyed: shares may outlive static teardown
    return *runner;
  }

  void Submit(Share* s) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(s);
    }
    cv_.notify_one();
  }

 private:
  Runner() : thread_([this] { Loop(); }) { thread_.detach(); }

  void Loop() {
    for (;;) {
      Share* s;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return !queue_.empty(); });
        s = queue_.front();
        queue_.pop_front();
      }
      s->RunOnce();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Share*> queue_;
  std::thread thread_;
};

void Share::MarkReady() { Runner::Get().Submit(this); }

Share* AsShare(int64_t handle) { return reinterpret_cast<Share*>(static_cast<intptr_t>(handle)); }

ffi::Error CheckStart(Share* s, const ffi::Buffer<ffi::F32>& q,
                      const ffi::Buffer<ffi::S32>& q_pos) {
  if (s == nullptr || s->args == nullptr) {
    return ffi::Error::InvalidArgument("rkv_share_start: the share is not configured");
  }
  if (q.size_bytes() != s->q_bytes || q_pos.size_bytes() != s->q_pos_bytes) {
    return ffi::Error::InvalidArgument(
        "rkv_share_start: q / q_pos sizes " + std::to_string(q.size_bytes()) + " / " +
        std::to_string(q_pos.size_bytes()) + " bytes, the share was configured for " +
        std::to_string(s->q_bytes) + " / " + std::to_string(s->q_pos_bytes));
  }
  {
    std::lock_guard<std::mutex> lock(s->mu);
    if (s->started != s->awaited) {
      return ffi::Error::Internal("rkv_share_start: the previous start of this share was not "
                                  "awaited (starts and waits alternate)");
    }
    ++s->started;
  }
  return ffi::Error::Success();
}

ffi::Error CheckWait(Share* s, const ffi::Result<ffi::Buffer<ffi::F32>>& o,
                     const ffi::Result<ffi::Buffer<ffi::F32>>& lse) {
  if (s == nullptr || s->args == nullptr) {
    return ffi::Error::InvalidArgument("rkv_share_wait: the share is not configured");
  }
  if (o->element_count() != s->o_elems || lse->element_count() != s->lse_elems) {
    return ffi::Error::InvalidArgument("rkv_share_wait: output sizes differ from the share's");
  }
  return ffi::Error::Success();
}

// --- CPU platform ------------------------------------------------------------------------------
ffi::Error StartCpu(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> q_pos, int64_t handle,
                    ffi::Result<ffi::BufferR0<ffi::S32>> token) {
  Share* s = AsShare(handle);
  if (ffi::Error e = CheckStart(s, q, q_pos); e.failure()) return e;
  *token->typed_data() = 0;
  std::memcpy(s->q, q.untyped_data(), s->q_bytes);
  std::memcpy(s->q_pos, q_pos.untyped_data(), s->q_pos_bytes);
  s->MarkReady();
  return ffi::Error::Success();
}

ffi::Error WaitCpu(ffi::BufferR0<ffi::S32> token, int64_t handle,
                   ffi::Result<ffi::Buffer<ffi::F32>> o, ffi::Result<ffi::Buffer<ffi::F32>> lse) {
  (void)token;
  Share* s = AsShare(handle);
  if (ffi::Error e = CheckWait(s, o, lse); e.failure()) return e;
  if (ffi::Error e = s->AwaitOne(); e.failure()) return e;
  std::memcpy(o->untyped_data(), s->o, s->o_elems * sizeof(float));
  std::memcpy(lse->untyped_data(), s->lse, s->lse_elems * sizeof(float));
  return ffi::Error::Success();
}

// --- CUDA platform (driver API through dlopen) -------------------------------------------------
using CuResult = int;
using CuMemcpyDtoHAsync = CuResult (*)(void*, uint64_t, size_t, void*);
using CuMemcpyHtoDAsync = CuResult (*)(uint64_t, const void*, size_t, void*);
using CuLaunchHostFunc = CuResult (*)(void*, void (*)(void*), void*);

struct Driver {
  CuMemcpyDtoHAsync dtoh = nullptr;
  CuMemcpyHtoDAsync htod = nullptr;
  CuLaunchHostFunc host_func = nullptr;
  std::string error;
};

const Driver& GetDriver() {
  static const Driver driver = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d.error = std::string("cannot open libcuda.so.1: ") + dlerror();
      return d;
    }
    d.dtoh = reinterpret_cast<CuMemcpyDtoHAsync>(dlsym(lib, "cuMemcpyDtoHAsync_v2"));
    d.htod = reinterpret_cast<CuMemcpyHtoDAsync>(dlsym(lib, "cuMemcpyHtoDAsync_v2"));
    d.host_func = reinterpret_cast<CuLaunchHostFunc>(dlsym(lib, "cuLaunchHostFunc"));
    if (!d.dtoh || !d.htod || !d.host_func) d.error = "libcuda.so.1 lacks a driver entry point";
    return d;
  }();
  return driver;
}

void OnQueryOnHost(void* share) { static_cast<Share*>(share)->MarkReady(); }  // no CUDA calls

ffi::Error StartCuda(void* stream, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> q_pos,
                     int64_t handle, ffi::Result<ffi::BufferR0<ffi::S32>> token) {
  (void)token;  // orders the wait; its value is never read
  const Driver& cu = GetDriver();
  if (!cu.error.empty()) return ffi::Error::Internal("rkv_share_start: " + cu.error);
  Share* s = AsShare(handle);
  if (ffi::Error e = CheckStart(s, q, q_pos); e.failure()) return e;
  CuResult r = cu.dtoh(s->q, reinterpret_cast<uint64_t>(q.untyped_data()), s->q_bytes, stream);
  if (r == 0)
    r = cu.dtoh(s->q_pos, reinterpret_cast<uint64_t>(q_pos.untyped_data()), s->q_pos_bytes,
                stream);
  if (r == 0) r = cu.host_func(stream, &OnQueryOnHost, s);
  if (r != 0) {
    return ffi::Error::Internal("rkv_share_start: a CUDA driver call failed (CUresult " +
                                std::to_string(r) + ")");
  }
  return ffi::Error::Success();
}

ffi::Error WaitCuda(void* stream, ffi::BufferR0<ffi::S32> token, int64_t handle,
                    ffi::Result<ffi::Buffer<ffi::F32>> o, ffi::Result<ffi::Buffer<ffi::F32>> lse) {
  (void)token;
  const Driver& cu = GetDriver();
  if (!cu.error.empty()) return ffi::Error::Internal("rkv_share_wait: " + cu.error);
  Share* s = AsShare(handle);
  if (ffi::Error e = CheckWait(s, o, lse); e.failure()) return e;
  if (ffi::Error e = s->AwaitOne(); e.failure()) return e;
  CuResult r = cu.htod(reinterpret_cast<uint64_t>(o->untyped_data()), s->o,
                       s->o_elems * sizeof(float), stream);
  if (r == 0)
    r = cu.htod(reinterpret_cast<uint64_t>(lse->untyped_data()), s->lse,
                s->lse_elems * sizeof(float), stream);
  if (r != 0) {
    return ffi::Error::Internal("rkv_share_wait: a CUDA driver call failed (CUresult " +
                                std::to_string(r) + ")");
  }
  return ffi::Error::Success();
}

}  // namespace

// No handler is command-buffer compatible (no kCmdBufferCompatible trait): each must run at
// every launch, never be replayed from a recorded graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(RkvShareStartCpu, StartCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("share")
                                  .Ret<ffi::BufferR0<ffi::S32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(RkvShareWaitCpu, WaitCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Attr<int64_t>("share")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(RkvShareStartCuda, StartCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("share")
                                  .Ret<ffi::BufferR0<ffi::S32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(RkvShareWaitCuda, WaitCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Attr<int64_t>("share")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" {

int rkv_share_abi_version(void) { return 1; }

void* rkv_share_new(void* kernel) {
  Share* s = new Share();
  s->kernel = reinterpret_cast<KernelFn>(kernel);
  Runner::Get();  // the runner thread exists before the first start
  return s;
}

// The kernel's arguments and the share's buffers; only between a wait and the next start.
int rkv_share_configure(void* share, const void* args, int num_threads, int64_t chunk, float* q,
                        int64_t q_bytes, int32_t* q_pos, int64_t q_pos_bytes, float* o,
                        int64_t o_elems, float* lse, int64_t lse_elems) {
  Share* s = static_cast<Share*>(share);
  std::lock_guard<std::mutex> lock(s->mu);
  if (s->started != s->awaited) return -1;  // a start is pending
  s->args = args;
  s->num_threads = num_threads;
  s->chunk = chunk;
  s->q = q;
  s->q_bytes = static_cast<size_t>(q_bytes);
  s->q_pos = q_pos;
  s->q_pos_bytes = static_cast<size_t>(q_pos_bytes);
  s->o = o;
  s->o_elems = static_cast<size_t>(o_elems);
  s->lse = lse;
  s->lse_elems = static_cast<size_t>(lse_elems);
  return 0;
}

// Seconds a wait blocks for its start's kernel before it fails (default 120).
void rkv_share_set_wait_seconds(void* share, double seconds) {
  Share* s = static_cast<Share*>(share);
  std::lock_guard<std::mutex> lock(s->mu);
  s->wait_seconds = seconds;
}

// starts, waits, kernel runs done, the last return code (for tests and diagnostics).
void rkv_share_counters(void* share, int64_t* out) {
  Share* s = static_cast<Share*>(share);
  std::lock_guard<std::mutex> lock(s->mu);
  out[0] = static_cast<int64_t>(s->started);
  out[1] = static_cast<int64_t>(s->awaited);
  out[2] = static_cast<int64_t>(s->done);
  out[3] = s->last_rc;
}

// Frees the share once every start has run (10 s at most); a share whose start never ran (its
// query's copy never landed) is left allocated: the runner or a host function may still name it.
void rkv_share_free(void* share) {
  Share* s = static_cast<Share*>(share);
  bool idle;
  {
    std::unique_lock<std::mutex> lock(s->mu);
    idle = s->cv.wait_for(lock, std::chrono::seconds(10), [&] { return s->done >= s->started; });
  }
  if (idle) delete s;
}

}  // extern "C"
