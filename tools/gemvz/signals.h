// Ctrl-C, kill and a closed terminal leave no temporary files behind: the handlers remove every
// file registered in runtime/common/temp_files.h, then let the signal end the process as it would
// have (the exit status still says which signal).
#pragma once

namespace gemvz::cli {

// Installs handlers for SIGINT, SIGTERM and SIGHUP; a signal that was ignored when the program
// started (nohup, a background job of a non-interactive shell) stays ignored. Call once, early in
// main, before any thread starts.
void InstallTempFileCleanupOnSignals();

}  // namespace gemvz::cli
