// strobe_tensorboard_write <log_dir>: writes a fixed set of events with EventFileWriter (for the
// Python test that reads them back with TensorBoard's EventAccumulator and protobuf classes).
// Values: train/loss = 1 / (step + 1) for steps 0..99, val/acc = step / 100 at steps 0, 10, ..., 90,
// edge/zero = 0 at step 0, edge/neg = -2.5 at step 3, edge/big_step = 7 at step 2^40 + 1,
// text "notes" = "hello *tensorboard*" at step 5, hparams {lr: 0.1, optimizer: adamw, name: a|b}.
#include "framework/logging/tensorboard/event_writer.h"

#include <cstdio>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <log_dir>\n", argv[0]);
    return 2;
  }
  namespace tb = strobe::logging::tensorboard;
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
