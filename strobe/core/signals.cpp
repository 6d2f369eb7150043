#include "strobe/core/signals.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <cstring>

#include "strobe/checkpoint/checkpoint_io.h"
#include "strobe/checkpoint/mapped_file.h"

namespace strobe::signals {
namespace {

std::atomic<int> g_received{0};
std::atomic<int64_t> g_step{0};
std::atomic<int64_t> g_announced{-1};
enum Phase : int { kBefore = 0, kLoop = 1, kAfter = 2 };
std::atomic<int> g_phase{kBefore};
bool g_installed = false;
bool g_sigint_ignored = false;
// Texts the handler writes: prepared outside it (the handler may only call async-signal-safe
// functions: write, _exit).
char g_save_target[1024] = "checkpoints/last.ckpt";
char g_command[64] = "";  // set_command: a command that does not train ("" for fit)

void put(char*& p, const char* end, const char* s) {
  while (*s && p < end) *p++ = *s++;
}

void put_int(char*& p, const char* end, int64_t v) {
  char digits[24];
  int n = 0;
  if (v < 0) {
    put(p, end, "-");
    v = -v;
  }
  do digits[n++] = static_cast<char>('0' + v % 10), v /= 10;
  while (v > 0 && n < 24);
  while (n > 0 && p < end) *p++ = digits[--n];
}

const char* name_of(int sig) { return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "signal"; }

void say(const char* text, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(STDERR_FILENO, text, n);
    if (w <= 0) return;
    text += w, n -= static_cast<size_t>(w);
  }
}

extern "C" void on_signal(int sig) {
  char buf[1400];
  char* p = buf;
  const char* end = buf + sizeof buf - 2;
  const int phase = g_phase.load();
  if (phase != kLoop) {
    checkpoint::unlink_pending_temp_files();  // an output being written is left as it was, no temporary
    if (g_command[0] != '\0') {
      put(p, end, "\nstrobe ");
      put(p, end, g_command);
      put(p, end, ": ");
      put(p, end, name_of(sig));
      put(p, end, " received; stopped (an output it was writing is left as it was)\n");
    } else {
      put(p, end, "\nstrobe: ");
      put(p, end, name_of(sig));
      put(p, end, phase == kBefore ? " received before training started; exiting (nothing to save)\n"
                                   : " received after training ended; exiting\n");
    }
    say(buf, static_cast<size_t>(p - buf));
    _exit(128 + sig);
  }
  int expected = 0;
  if (g_received.compare_exchange_strong(expected, sig)) {
    // The loop honours what is announced here: it finishes this step, or stops before the next one.
    const int64_t step = g_step.load();
    g_announced.store(step);
    put(p, end, "\nstrobe fit: ");
    put(p, end, name_of(sig));
    put(p, end, " received: finishing step ");
    put_int(p, end, step);
    put(p, end, ", then saving ");
    put(p, end, g_save_target);
    put(p, end, " (a second signal stops at once without saving)\n");
    say(buf, static_cast<size_t>(p - buf));
    return;
  }
  checkpoint::unlink_pending_temp_files();
  put(p, end, "\nstrobe fit: second signal (");
  put(p, end, name_of(sig));
  put(p, end, "): stopping now; nothing was saved (the last checkpoint written before stays as it was)\n");
  say(buf, static_cast<size_t>(p - buf));
  _exit(128 + sig);
}

// A memory-mapped input truncated under the process: the read of a lost page raises SIGBUS, which
// would end Strobe without a word. One line naming the file (checkpoint::mapped_file_at), exit 1.
extern "C" void on_sigbus(int, siginfo_t* info, void*) {
  char buf[1400];
  char* p = buf;
  const char* end = buf + sizeof buf - 2;
  const char* file = checkpoint::mapped_file_at(info->si_addr);
  put(p, end, "\nstrobe: error: ");
  put(p, end, file != nullptr ? file : "a memory-mapped file");
  put(p, end, ": the file changed under the run (truncated or rewritten while it was read); restore it and resume from the "
              "last checkpoint\n");
  say(buf, static_cast<size_t>(p - buf));
  _exit(1);
}

void copy(char* dst, size_t cap, const std::string& s) {
  const size_t n = std::min(cap - 1, s.size());
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

void handle(int sig) {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGINT);
  sigaddset(&sa.sa_mask, SIGTERM);
  sigaction(sig, &sa, nullptr);
}

}  // namespace

void install() {
  if (g_installed) return;
  g_installed = true;
  struct sigaction old {};
  sigaction(SIGINT, nullptr, &old);
  g_sigint_ignored = old.sa_handler == SIG_IGN;
  if (!g_sigint_ignored) handle(SIGINT);
  handle(SIGTERM);
  // A file-size limit (ulimit -f) would kill the process mid-write: ignored, the write fails with
  // EFBIG instead, and the writer removes its temp file and says which file (checkpoint::WriteError).
  signal(SIGXFSZ, SIG_IGN);
  struct sigaction bus {};
  bus.sa_sigaction = on_sigbus;
  bus.sa_flags = SA_SIGINFO;
  sigemptyset(&bus.sa_mask);
  sigaction(SIGBUS, &bus, nullptr);
}

bool sigint_inherited_ignored() { return g_sigint_ignored; }

void set_command(const std::string& name) { copy(g_command, sizeof g_command, name); }

void enter_training_loop(const std::string& save_target) {
  install();  // a program embedding the trainer may not have
  copy(g_save_target, sizeof g_save_target, save_target);
  g_phase.store(kLoop);
}

void leave_training_loop() { g_phase.store(kAfter); }

void set_current_step(int64_t step) { g_step.store(step, std::memory_order_relaxed); }

int received() { return g_received.load(); }

int64_t announced_step() { return g_announced.load(); }

void reset() {
  g_received.store(0);
  g_announced.store(-1);
  g_phase.store(kBefore);
}

}  // namespace strobe::signals
