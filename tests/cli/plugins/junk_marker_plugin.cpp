// A plugin whose Strobe marker section holds binary junk (control bytes, a newline, invalid UTF-8)
// instead of the marker text: refused naming it in one line, the bytes escaped.
__attribute__((section(".strobe_plugin"), used)) static const char kJunkMarker[] = "\x01\x7f\xff\xfe\nsecond line\x1b[31m";

int plugin_junk_marker_placeholder() { return 0; }
