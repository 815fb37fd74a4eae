// Status plumbing that Debian's Abseil 20220623 lacks: early return on error, and unwrap-or-return.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define GEMVZ_CONCAT_INNER_(a, b) a##b
#define GEMVZ_CONCAT_(a, b) GEMVZ_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                   \
  do {                                          \
    const ::absl::Status _gemvz_st = (expr);    \
    if (!_gemvz_st.ok()) return _gemvz_st;      \
  } while (0)

#define ASSIGN_OR_RETURN(lhs, expr) \
  GEMVZ_ASSIGN_OR_RETURN_IMPL_(GEMVZ_CONCAT_(_gemvz_sor_, __LINE__), lhs, expr)

#define GEMVZ_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return std::move(tmp).status();     \
  lhs = std::move(tmp).value()
