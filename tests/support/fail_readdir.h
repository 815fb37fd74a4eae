// Fault injection for directory listings: this test support object defines readdir, which the
// library (linked statically into the test binary) then calls. It fails with
// g_readdir_error once g_readdir_entries_left entries (of any listing) have been read; -1, the
// default, never. Linked into a test binary only when the test names one of the two.
#pragma once

#include <atomic>

extern std::atomic<int> g_readdir_entries_left;
extern std::atomic<int> g_readdir_error;
