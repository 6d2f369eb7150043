// A plugin with nothing in it: what the version and marker checks refuse before loading it.
int plugin_empty_placeholder() { return 0; }
