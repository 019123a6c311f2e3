// The call guard of a cache: DESIGN.md rule 8, once, for every backend that uses it.
//
// Owns the two rules the built-in caches share:
//   * a cache is never re-entered from its own callbacks: a call made while the same
//     thread is already inside a call of the same cache (from an eviction policy, a
//     hook, a token object's tolist() or __index__, a request id's __hash__ ...)
//     raises RuntimeError naming both calls, before it has changed anything;
//   * several threads may call one cache: each call holds the cache's lock for its
//     whole length, so calls run one at a time; a thread that finds the lock taken
//     waits with the GIL released (so the holder can finish), and a signal handler
//     that raises (Ctrl-C) ends the wait.
//
// `CallGuard(name)` is a cache's state: the thread inside (an atomic word that is the
// lock: entering is one compare-and-swap, leaving one store) and, for threads that find
// it taken, a mutex and condition variable to sleep on (CPython's own lock reads the
// clock on every acquire, which cost more than the rest of the guard). `guarded(f)`
// wraps a method: each call enters the guard held in its `self`'s `_call_guard`
// attribute and leaves it when `f` returns or raises. The wrapper is a method
// descriptor with vectorcall (no bound-method object per call), so an uncontended
// call costs one attribute look-up, one compare-and-swap and one store.
//
// Never does: decide what a call does, time a call out, or help a callback that waits
// for another thread's call of the same cache (that deadlocks: the callback's thread
// holds the lock until its own call returns).
#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>

namespace py = pybind11;

namespace prefixcache {
namespace {

// What waiting needs; C++ objects, so a PyObject holds them by pointer.
struct GuardState {
  std::atomic<unsigned long> owner{0};  // thread inside a call, 0 if none: the lock itself
  std::atomic<int> waiters{0};          // threads asleep on `wake` (changed under `mutex`)
  std::mutex mutex;
  std::condition_variable wake;
};

struct CallGuardObject {
  PyObject_HEAD
  GuardState* state;
  PyObject* name;     // the cache's name, for messages
  PyObject* running;  // the call inside (a str), or nullptr; set by the owner, with the GIL
};

struct GuardedMethodObject {
  PyObject_HEAD
  PyObject* func;
  PyObject* name;  // the method's name, for messages
  PyObject* dict;  // __wrapped__, __doc__, __qualname__ ... (functools.update_wrapper)
  vectorcallfunc vectorcall;
};

PyTypeObject CallGuardType = {PyVarObject_HEAD_INIT(nullptr, 0)};
PyTypeObject GuardedMethodType = {PyVarObject_HEAD_INIT(nullptr, 0)};
PyObject* guard_attribute = nullptr;  // interned "_call_guard", kept for the process
PyObject* with_block = nullptr;       // interned "with", what a `with guard:` block is called

// Sleeps, without the GIL, until this thread owns the guard; wakes every 50 ms to run
// signal handlers (Ctrl-C ends the wait with their error: -1).
int wait_for(GuardState& st, unsigned long me) {
  for (;;) {
    bool got = false;
    Py_BEGIN_ALLOW_THREADS
    {
      std::unique_lock<std::mutex> hold(st.mutex);
      st.waiters.fetch_add(1);
      for (unsigned long none = 0; !(got = st.owner.compare_exchange_strong(none, me)); none = 0) {
        if (st.wake.wait_for(hold, std::chrono::milliseconds(50)) == std::cv_status::timeout) break;
      }
      st.waiters.fetch_sub(1);
    }  // the mutex is released before the GIL is taken back: a leaving owner may need it
    Py_END_ALLOW_THREADS
    if (got) return 0;
    if (PyErr_CheckSignals() < 0) return -1;
  }
}

int guard_enter(CallGuardObject* g, PyObject* what) {
  const unsigned long me = PyThread_get_thread_ident();
  GuardState& st = *g->state;
  if (st.owner.load(std::memory_order_relaxed) == me) {
    PyErr_Format(PyExc_RuntimeError,
                 "%U.%U() was called while %U.%U() is running on the same thread: a cache is never re-entered "
                 "from its own callbacks (eviction policy, hooks, a token object's tolist()/__index__, a request "
                 "id's __hash__); this call changed nothing",
                 g->name, what, g->name, g->running != nullptr ? g->running : with_block);
    return -1;
  }
  unsigned long none = 0;
  if (!st.owner.compare_exchange_strong(none, me) && wait_for(st, me) < 0) return -1;
  Py_INCREF(what);
  g->running = what;
  return 0;
}

void guard_exit(CallGuardObject* g) {
  PyObject* what = g->running;  // a str: dropping it runs no Python code, so a pending error stays
  g->running = nullptr;
  GuardState& st = *g->state;
  st.owner.store(0);
  // A sleeper counted itself before its last try for the guard (both sequentially
  // consistent), so either it saw the guard free or it is counted here; taking the
  // mutex waits until it sleeps, so the wake-up is not lost.
  if (st.waiters.load() > 0) {
    std::lock_guard<std::mutex> hold(st.mutex);
    st.wake.notify_one();
  }
  Py_XDECREF(what);
}

// ---------------------------------------------------------------- CallGuard

PyObject* call_guard_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"name", nullptr};
  PyObject* name = nullptr;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "U:CallGuard", const_cast<char**>(keywords), &name)) return nullptr;
  auto* g = reinterpret_cast<CallGuardObject*>(type->tp_alloc(type, 0));
  if (g == nullptr) return nullptr;
  g->state = new (std::nothrow) GuardState();
  if (g->state == nullptr) {
    Py_DECREF(g);
    return PyErr_NoMemory();
  }
  Py_INCREF(name);
  g->name = name;
  return reinterpret_cast<PyObject*>(g);
}

void call_guard_dealloc(PyObject* self) {
  auto* g = reinterpret_cast<CallGuardObject*>(self);
  delete g->state;  // nobody is inside or waiting: each caller holds a reference to the guard
  Py_XDECREF(g->name);
  Py_XDECREF(g->running);
  Py_TYPE(self)->tp_free(self);
}

PyObject* call_guard_enter(PyObject* self, PyObject*) {
  if (guard_enter(reinterpret_cast<CallGuardObject*>(self), with_block) < 0) return nullptr;
  Py_INCREF(self);
  return self;
}

PyObject* call_guard_exit(PyObject* self, PyObject* const*, Py_ssize_t) {
  auto* g = reinterpret_cast<CallGuardObject*>(self);
  if (g->state->owner.load() != PyThread_get_thread_ident()) {
    PyErr_Format(PyExc_RuntimeError, "%U: the call guard was left by a thread that is not inside it", g->name);
    return nullptr;
  }
  guard_exit(g);
  Py_RETURN_FALSE;
}

PyObject* call_guard_held(PyObject* self, void*) {
  return PyBool_FromLong(reinterpret_cast<CallGuardObject*>(self)->state->owner.load() != 0);
}

PyObject* call_guard_name(PyObject* self, void*) {
  PyObject* name = reinterpret_cast<CallGuardObject*>(self)->name;
  Py_INCREF(name);
  return name;
}

PyMethodDef call_guard_methods[] = {
    {"__enter__", call_guard_enter, METH_NOARGS, "Enter the guard: wait for the lock; RuntimeError if this thread is inside."},
    {"__exit__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_guard_exit)), METH_FASTCALL,
     "Leave the guard."},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef call_guard_getset[] = {
    {"held", call_guard_held, nullptr, "Whether a thread is inside a call.", nullptr},
    {"name", call_guard_name, nullptr, "The cache's name, as messages give it.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

// ---------------------------------------------------------------- guarded(method)

PyObject* guarded_vectorcall(PyObject* callable, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* m = reinterpret_cast<GuardedMethodObject*>(callable);
  if (PyVectorcall_NARGS(nargsf) < 1) {
    PyErr_Format(PyExc_TypeError, "%U() needs the cache as its first argument", m->name);
    return nullptr;
  }
  PyObject* guard = PyObject_GetAttr(args[0], guard_attribute);
  if (guard == nullptr || Py_TYPE(guard) != &CallGuardType) {
    Py_XDECREF(guard);
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError,
                 "%U(): %s has no call guard (PrefixCache.__init__ sets self._call_guard; did __init__ call "
                 "super().__init__()?)",
                 m->name, Py_TYPE(args[0])->tp_name);
    return nullptr;
  }
  auto* g = reinterpret_cast<CallGuardObject*>(guard);
  if (guard_enter(g, m->name) < 0) {
    Py_DECREF(guard);
    return nullptr;
  }
  PyObject* out = PyObject_Vectorcall(m->func, args, nargsf, kwnames);
  guard_exit(g);
  Py_DECREF(guard);
  return out;
}

PyObject* guarded_descr_get(PyObject* self, PyObject* obj, PyObject*) {
  if (obj == nullptr || obj == Py_None) {
    Py_INCREF(self);
    return self;
  }
  return PyMethod_New(self, obj);
}

int guarded_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* m = reinterpret_cast<GuardedMethodObject*>(self);
  Py_VISIT(m->func);
  Py_VISIT(m->dict);
  return 0;
}

int guarded_clear(PyObject* self) {
  auto* m = reinterpret_cast<GuardedMethodObject*>(self);
  Py_CLEAR(m->func);
  Py_CLEAR(m->dict);
  return 0;
}

void guarded_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  guarded_clear(self);
  Py_CLEAR(reinterpret_cast<GuardedMethodObject*>(self)->name);
  Py_TYPE(self)->tp_free(self);
}

PyObject* guarded_repr(PyObject* self) {
  return PyUnicode_FromFormat("<guarded %R>", reinterpret_cast<GuardedMethodObject*>(self)->func);
}

PyGetSetDef guarded_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

// guarded(function): the method wrapper (see the top of this file).
PyObject* guarded_new(PyObject*, PyObject* func) {
  if (!PyCallable_Check(func)) {
    PyErr_Format(PyExc_TypeError, "guarded() takes a function, got %s", Py_TYPE(func)->tp_name);
    return nullptr;
  }
  PyObject* name = PyObject_GetAttrString(func, "__name__");
  if (name == nullptr || !PyUnicode_Check(name)) {
    Py_XDECREF(name);
    PyErr_Clear();
    name = PyUnicode_FromString("method");
    if (name == nullptr) return nullptr;
  }
  auto* m = PyObject_GC_New(GuardedMethodObject, &GuardedMethodType);
  if (m == nullptr) {
    Py_DECREF(name);
    return nullptr;
  }
  Py_INCREF(func);
  m->func = func;
  m->name = name;
  m->dict = nullptr;
  m->vectorcall = guarded_vectorcall;
  PyObject_GC_Track(m);
  return reinterpret_cast<PyObject*>(m);
}

PyMethodDef guarded_def = {"guarded", guarded_new, METH_O, R"doc(guarded(method)

A method of a cache, run inside the cache's call guard (`self._call_guard`, a
CallGuard): other threads' calls wait, and a call from inside the running one (a
callback) raises RuntimeError before it changes anything. Use
`prefixcache.protocol.guarded`, which also copies the method's name and docstring.
)doc"};

}  // namespace

void bind_call_guard(py::module_& m) {
  guard_attribute = PyUnicode_InternFromString("_call_guard");
  with_block = PyUnicode_InternFromString("with");
  if (guard_attribute == nullptr || with_block == nullptr) throw py::error_already_set();

  CallGuardType.tp_name = "prefixcache._C.CallGuard";
  CallGuardType.tp_basicsize = sizeof(CallGuardObject);
  CallGuardType.tp_flags = Py_TPFLAGS_DEFAULT;
  CallGuardType.tp_doc = R"doc(CallGuard(name)

One cache's call guard (DESIGN.md rule 8): a lock held for the whole of each call, and
the thread inside. Entering it from the thread already inside raises RuntimeError
naming both calls; entering it from another thread waits, with the GIL released.
`with guard:` enters it; `prefixcache.protocol.guarded` methods enter their cache's.
)doc";
  CallGuardType.tp_new = call_guard_new;
  CallGuardType.tp_dealloc = call_guard_dealloc;
  CallGuardType.tp_methods = call_guard_methods;
  CallGuardType.tp_getset = call_guard_getset;
  CallGuardType.tp_free = PyObject_Del;

  GuardedMethodType.tp_name = "prefixcache._C.GuardedMethod";
  GuardedMethodType.tp_basicsize = sizeof(GuardedMethodObject);
  GuardedMethodType.tp_flags =
      Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_METHOD_DESCRIPTOR | Py_TPFLAGS_HAVE_VECTORCALL;
  GuardedMethodType.tp_doc = "A cache method run inside its cache's call guard (see guarded).";
  GuardedMethodType.tp_vectorcall_offset = offsetof(GuardedMethodObject, vectorcall);
  GuardedMethodType.tp_dictoffset = offsetof(GuardedMethodObject, dict);
  GuardedMethodType.tp_call = PyVectorcall_Call;
  GuardedMethodType.tp_descr_get = guarded_descr_get;
  GuardedMethodType.tp_traverse = guarded_traverse;
  GuardedMethodType.tp_clear = guarded_clear;
  GuardedMethodType.tp_dealloc = guarded_dealloc;
  GuardedMethodType.tp_repr = guarded_repr;
  GuardedMethodType.tp_free = PyObject_GC_Del;
  GuardedMethodType.tp_getset = guarded_getset;

  for (PyTypeObject* type : {&CallGuardType, &GuardedMethodType}) {
    if (PyType_Ready(type) < 0) throw py::error_already_set();
  }
  Py_INCREF(&CallGuardType);
  m.add_object("CallGuard", reinterpret_cast<PyObject*>(&CallGuardType));
  auto fn = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&guarded_def, nullptr, m.attr("__name__").ptr()));
  if (!fn) throw py::error_already_set();
  m.add_object("guarded", fn);
}

}  // namespace prefixcache
