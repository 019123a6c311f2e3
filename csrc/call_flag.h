// The "a call is running" flag of a native object whose calls run Python code part-way:
// a caller's ranking in RadixTree::evict_by, a Python policy and its keys' comparisons
// in BlockEvictor<PyKey>. Code that calls back into the object from there would change
// what the running call holds (tree nodes, heap entries) under it.
//
// Owns ReentryError (a std::runtime_error: RuntimeError in Python) and CallFlag. A call
// that may run Python code holds a CallFlag::Scope for its whole length; every call that
// changes the object calls check() first, which throws while a scope is open, before
// anything changes. Reads stay allowed (they change nothing a running call holds).
//
// Never does: lock. The native objects are not thread-safe; the caches that own them
// are (csrc/call_guard.cpp), and refuse re-entry before it gets here.
#pragma once

#include <stdexcept>
#include <string>

namespace prefixcache {

struct ReentryError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class CallFlag {
 public:
  class Scope {
   public:
    Scope(CallFlag& flag, const char* call) : flag_(flag) {
      flag.check(call);
      flag.running_ = call;
    }
    ~Scope() { flag_.running_ = nullptr; }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    CallFlag& flag_;
  };

  // Throws ReentryError if a call is running.
  void check(const char* call) const {
    if (running_ == nullptr) return;
    throw ReentryError(std::string(call) + "() was called while " + running_ +
                       "() is running (from a Python callback it made, or from another thread): it is never "
                       "re-entered; this call changed nothing");
  }

 private:
  const char* running_ = nullptr;
};

}  // namespace prefixcache
