// Ctrl-C, kill, a closed terminal and a bus error leave no temporary files behind: the handlers
// remove every file registered in runtime/common/temp_files.h, then let the signal end the process
// as it would have (the exit status still says which signal). A bus error (SIGBUS: a memory-mapped
// input that shrank while open, or whose storage failed) is also explained on stderr.
#pragma once

namespace gemvz::cli {

// Installs handlers for SIGINT, SIGTERM, SIGHUP and SIGBUS; a SIGINT, SIGTERM or SIGHUP that was
// ignored when the program started (nohup, a background job of a non-interactive shell) stays
// ignored. Call once, early in main, before any thread starts.
void InstallTempFileCleanupOnSignals();

}  // namespace gemvz::cli
