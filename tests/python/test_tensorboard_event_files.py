"""Event files written by Strobe's C++ TensorBoard writer load in TensorBoard's own reader.

Runs $STROBE_BUILD_DIR/bin/strobe_tensorboard_write into a temp dir, then:
  - EventAccumulator sees every scalar (tags, steps, float32 values) and the text/hparams entries;
  - every TFRecord's length and data CRCs (masked CRC32C) verify;
  - every record parses with tensorboard's generated Event class and re-serializes to the same
    bytes, i.e. our hand-written protobuf encoding is byte-identical to protobuf's.
Exit code 77 (skipped) when the tensorboard package is not importable.
"""
import os
import struct
import subprocess
import sys
import tempfile

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
except ImportError as e:  # pragma: no cover
    print(f"SKIP: tensorboard not importable: {e}")
    sys.exit(77)

import numpy as np


def read_records(path):
    records = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (len_crc,) = struct.unpack("<I", data[pos + 8 : pos + 12])
        assert len_crc == masked_crc32c(header), f"length CRC mismatch at offset {pos}"
        body = data[pos + 12 : pos + 12 + length]
        (body_crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
        assert body_crc == masked_crc32c(body), f"data CRC mismatch at offset {pos}"
        records.append(body)
        pos += 16 + length
    assert pos == len(data), "trailing bytes after the last record"
    return records


def main():
    build = os.environ.get("STROBE_BUILD_DIR")
    assert build, "STROBE_BUILD_DIR is not set (ctest sets it)"
    tool = os.path.join(build, "bin", "strobe_tensorboard_write")
    assert os.path.exists(tool), f"{tool} not built (strobe/logging/tensorboard/CMakeLists.txt)"
    with tempfile.TemporaryDirectory() as tmp:
        path = subprocess.run([tool, tmp], check=True, capture_output=True, text=True).stdout.strip()
        assert os.path.basename(path).startswith("events.out.tfevents."), path

        records = read_records(path)
        events = [event_pb2.Event.FromString(r) for r in records]
        assert events[0].file_version == "brain.Event:2"
        for raw, ev in zip(records, events):
            assert ev.SerializeToString() == raw, f"not byte-identical to protobuf:\n{ev}\n{raw!r}"

        ea = EventAccumulator(tmp, size_guidance={"scalars": 0, "tensors": 0})
        ea.Reload()
        tags = ea.Tags()
        assert set(tags["scalars"]) == {"train/loss", "val/acc", "edge/zero", "edge/neg", "edge/big_step"}, tags
        loss = ea.Scalars("train/loss")
        assert [e.step for e in loss] == list(range(100))
        assert np.allclose([e.value for e in loss], [np.float32(1.0 / (s + 1)) for s in range(100)], rtol=0, atol=0)
        acc = ea.Scalars("val/acc")
        assert [e.step for e in acc] == list(range(0, 100, 10))
        assert np.allclose([e.value for e in acc], [np.float32(s / 100.0) for s in range(0, 100, 10)], rtol=0, atol=0)
        assert [(e.step, e.value) for e in ea.Scalars("edge/zero")] == [(0, 0.0)]
        assert [(e.step, e.value) for e in ea.Scalars("edge/neg")] == [(3, -2.5)]
        assert [(e.step, e.value) for e in ea.Scalars("edge/big_step")] == [((1 << 40) + 1, 7.0)]
        assert all(e.wall_time > 1.6e9 for e in loss)

        text_tags = ea.PluginTagToContent("text")
        assert set(text_tags) == {"notes", "hparams"}, text_tags
        notes = ea.Tensors("notes")
        assert [e.step for e in notes] == [5]
        assert notes[0].tensor_proto.string_val == [b"hello *tensorboard*"]
        hp = ea.Tensors("hparams")[0].tensor_proto.string_val[0].decode()
        assert "| lr | 0.1 |" in hp and "| optimizer | adamw |" in hp and "| name | a\\|b |" in hp, hp
    print(f"OK: {len(records)} records, byte-identical to protobuf, loaded by EventAccumulator")
    check_restart_marker(tool)


def check_restart_marker(tool):
    """A resumed run's SessionLog START at step 50 hides the steps >= 50 that the crashed run logged
    after its checkpoint; the resumed values replace them and nothing is shown twice."""
    with tempfile.TemporaryDirectory() as tmp:
        path = subprocess.run([tool, tmp, "restart"], check=True, capture_output=True, text=True).stdout.strip()
        files = sorted(f for f in os.listdir(tmp) if f.startswith("events.out.tfevents."))
        assert len(files) == 2 and os.path.basename(path) == files[-1], (files, path)
        records = read_records(path)
        events = [event_pb2.Event.FromString(r) for r in records]
        for raw, ev in zip(records, events):
            assert ev.SerializeToString() == raw, f"not byte-identical to protobuf:\n{ev}\n{raw!r}"
        start = [e for e in events if e.HasField("session_log")]
        assert len(start) == 1 and start[0].session_log.status == event_pb2.SessionLog.START and start[0].step == 50, start
        ea = EventAccumulator(tmp, size_guidance={"scalars": 0})
        ea.Reload()
        loss = ea.Scalars("train/loss")
        assert [e.step for e in loss] == list(range(80)), [e.step for e in loss]
        assert [e.value for e in loss] == [float(s) for s in range(50)] + [float(1000 + s) for s in range(50, 80)]
    print("OK: the restart marker purges the crashed run's steps >= 50 in EventAccumulator")


if __name__ == "__main__":
    main()
