// Ctrl-C, kill, a closed terminal and a bus error leave no temporary files behind: the handlers
// remove every file registered in runtime/common/temp_files.h, then let the signal end the process
// as it would have (the exit status still says which signal). A signal that arrives during a
// multi-file publish waits for its end; a bus error the kernel raises (SIGBUS: a memory-mapped
// input that shrank while open, or whose storage failed) cannot wait, so it leaves a publish's
// files as they are, and it is explained on stderr.
#pragma once

namespace gemvz::cli {

// Installs handlers for SIGINT, SIGTERM, SIGHUP and SIGBUS; a SIGINT, SIGTERM or SIGHUP that was
// ignored when the program started (nohup, a background job of a non-interactive shell) stays
// ignored. A SIGBUS sent by another process is handled as SIGTERM is. Call once, early in main,
// before any thread starts.
void InstallTempFileCleanupOnSignals();

}  // namespace gemvz::cli
