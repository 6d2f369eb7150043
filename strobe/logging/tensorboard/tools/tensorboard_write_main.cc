// strobe_tensorboard_write <log_dir>: writes a fixed set of events with EventFileWriter (for the
// Python test that reads them back with TensorBoard's EventAccumulator and protobuf classes).
// Values: train/loss = 1 / (step + 1) for steps 0..99, val/acc = step / 100 at steps 0, 10, ..., 90,
// edge/zero = 0 at step 0, edge/neg = -2.5 at step 3, edge/big_step = 7 at step 2^40 + 1,
// text "notes" = "hello *tensorboard*" at step 5, hparams {lr: 0.1, optimizer: adamw, name: a|b}.
// strobe_tensorboard_write <log_dir> restart: a crashed run and its resumption, as two files: the first
// logs train/loss = step for steps 0..99 (as if killed at step 99 after a checkpoint at step 49), the
// second writes a restart marker at step 50 and logs train/loss = 1000 + step for steps 50..79.
#include "strobe/logging/tensorboard/event_writer.h"

#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: %s <log_dir> [restart]\n", argv[0]);
    return 2;
  }
  namespace tb = strobe::logging::tensorboard;
  if (argc == 3 && std::string(argv[2]) == "restart") {
    {
      tb::EventFileWriter crashed(argv[1]);
      for (int step = 0; step < 100; ++step) crashed.add_scalar("train/loss", step, step);
    }
    tb::EventFileWriter resumed(argv[1]);
    resumed.add_session_start(50, "checkpoints/last.ckpt");
    for (int step = 50; step < 80; ++step) resumed.add_scalar("train/loss", 1000 + step, step);
    resumed.close();
    std::printf("%s\n", resumed.path().c_str());
    return 0;
  }
  tb::EventFileWriter w(argv[1]);
  w.add_hparams({{"lr", "0.1"}, {"optimizer", "adamw"}, {"name", "a|b"}});
  for (int step = 0; step < 100; ++step) {
    w.add_scalar("train/loss", 1.0 / (step + 1), step);
    if (step % 10 == 0) w.add_scalar("val/acc", step / 100.0, step);
  }
  w.add_scalar("edge/zero", 0.0, 0);
  w.add_scalar("edge/neg", -2.5, 3);
  w.add_scalar("edge/big_step", 7.0, (int64_t{1} << 40) + 1);
  w.add_text("notes", "hello *tensorboard*", 5);
  w.close();
  std::printf("%s\n", w.path().c_str());
  return 0;
}
