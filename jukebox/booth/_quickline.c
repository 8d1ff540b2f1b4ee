/* The booth's control socket, read by compiled code: the unlabelled checkpoint an agent asks
 * for after a step the booth has already folded is answered here, without the interpreter
 * running any Python code before the answer leaves.
 *
 * Why: an agent asks for its checkpoint after waiting for its model, and by then every Python
 * frame on the path runs from cold caches, at 2-4 times its warm cost (docs/benchmarks.md, the
 * paused checkpoint). After a quiet fold (shadowfs.quiet_fold) the checkpoint is only a marker:
 * the tree and the journal are stored, and what is left is the syncfs, the fusectl count of
 * unanswered FUSE requests, the check that nothing changed since the fold, the checkpoint's
 * number and tape seq, and the answer. That is what this file does; the bookkeeping after the
 * answer (the journal let go, the store's flush scheduled, the checkpoint listed) stays in
 * Python (ControlServer._fast_taken, `_Run.fast_taken`), run while this path still holds every
 * lock it took, exactly as the Python path (`_Run.checkpoint_answering`) holds them.
 *
 * `serve(fd, line, gate, peer)` reads the connection once, with the interpreter lock released.
 * Bytes that are not exactly `line`, a `gate` of None, and any doubt return the bytes read,
 * for the Python path to serve unchanged (any doubt: a FUSE request unanswered after the
 * syncfs, a lock another thread holds, a change since the fold, an attribute missing, an
 * error). Answered, it returns (n, seq, tree, rest, errno): the checkpoint's number, frame seq
 * and tree id, what of the answer the socket did not take at once, and the send's errno (0 if none), with
 * the gate's four locks still held for the caller to finish and release.
 *
 * The locks are the Python objects themselves (`threading.Lock`, the mount's `RLock`), taken
 * without blocking as their own methods take them (`try_acquire`), in the order the Python path
 * takes them: the control server's turn, the run's lock, the layer lock, then the tape queue's
 * lock for the frame. The state is read from the same objects the Python path reads: the
 * layer's `_folded_journal`, `journal.changes`, `journal._count`, `root.dirty_names`,
 * `last_tree` (shadowfs.layer.Layer.snapshot's marker condition) and the tape queue's
 * `_count`, `_in_flight`, `_queue`, `_error`, `_thread` (jukebox.booth.supervisor.GroupTape
 * .append), each where its type keeps it (`slot_get`: a slot's offset, the instance dict).
 * What a request finds before its wait (the payload's dict, the agent's peer) is made then.
 *
 * After the agent's pause every cache line this path touches is cold (the host refilled the
 * caches while the vCPU was halted), so the path is written to touch few: no argument parsing,
 * no method lookups, no format strings between the request and its answer.
 *
 * The syncfs can wait on the layer's workers, which the booth's watchdog must be able to see
 * (jukebox.booth.layer_watchdog): `syncing(key)` gives when the oldest syncfs of `key` (the
 * fusectl connection number) began, in time.monotonic() seconds, or None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BUFSIZE 65536
#define SLOTS 64

static unsigned long long answered; /* changed with the interpreter lock held */

/* Names looked up on the path, made once: a string built per lookup costs, run cold. */
#define NAMES(X) X(acquire) X(release) X(_folded_journal) X(journal) X(changes) X(_count) \
    X(root) X(dirty_names) X(last_tree) X(databases) X(checkpoints) X(_lock) X(_error) \
    X(_thread) X(writer) X(_queue) X(_in_flight) X(id) X(label) X(reason) X(peer) \
    X(checkpoint) X(request) X(timeout) X(_buf) X(polls) X(sock) \
    X(fileno) X(close) X(pid) X(ok) X(tree) X(frame) X(op) X(_kept_lock) X(_request_kept) X(SPIN) X(_CPUS)
#define DECLARE(name) static PyObject *s_##name;
NAMES(DECLARE)
#undef DECLARE

static pthread_mutex_t slots_mutex = PTHREAD_MUTEX_INITIALIZER;
static struct {
    long key;
    double since; /* CLOCK_MONOTONIC seconds; 0: a free slot */
} slots[SLOTS];

static double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* syncfs(fd), seen by the watchdog meanwhile. Without the interpreter lock. */
static int watched_syncfs(int fd, long key) {
    int slot = -1;
    pthread_mutex_lock(&slots_mutex);
    for (int i = 0; i < SLOTS; i++) {
        if (slots[i].since == 0) {
            slots[i].key = key;
            slots[i].since = monotonic();
            slot = i;
            break;
        }
    }
    pthread_mutex_unlock(&slots_mutex);
    if (slot < 0)
        return -1; /* more syncfs calls than connections: let the watched Python path do it */
    int rc = syncfs(fd);
    pthread_mutex_lock(&slots_mutex);
    slots[slot].since = 0;
    pthread_mutex_unlock(&slots_mutex);
    return rc;
}

/* fusectl's `waiting` file of a connection's directory, opened for one `requests_waiting`, or
 * -1. The file cannot seek, so each count needs a file of its own; the kernel counts at the
 * first read, not at the open (fs/fuse/control.c, fuse_conn_waiting_read), so the file is
 * opened while the connection's thread waits for its request: after the agent's pause the
 * open's path lookup and file set-up ran cold on the checkpoint's path (31-39 us with the
 * read and close, traced idle and loaded, docs/benchmarks.md). */
static int open_waiting(int dir_fd) {
    return dir_fd < 0 ? -1 : openat(dir_fd, "waiting", O_RDONLY | O_CLOEXEC);
}

/* The count of unanswered requests now, read from `fd` (`open_waiting`, never read before), or
 * -1. */
static long requests_waiting(int fd) {
    if (fd < 0)
        return -1;
    char buf[32];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    if (n <= 0)
        return -1;
    buf[n] = 0;
    char *end;
    long value = strtol(buf, &end, 10);
    if (end == buf)
        return -1;
    return value;
}

/* The CPU the process `pid` (its main thread) last ran on, /proc/PID/stat's 39th field, or -1. */
static int last_cpu(long pid) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = 0;
    /* The command's name, field 2, may hold spaces and parentheses: the fields after it
     * start at its last ')'; the CPU is the 37th of them. */
    char *p = strrchr(buf, ')');
    for (int field = 0; field < 37 && p != NULL; field++) {
        p = strchr(p + 1, ' ');
    }
    if (p == NULL)
        return -1;
    char *end;
    long cpu = strtol(p + 1, &end, 10);
    return end == p + 1 || cpu < 0 || cpu >= CPU_SETSIZE ? -1 : (int)cpu;
}

/* Where the connection's thread waits for a checkpoint after a pause. On a virtual machine an
 * idle vCPU is halted, and a wake-up sent to it goes through the host: traced here (a paused
 * 10-file checkpoint, docs/benchmarks.md), this thread returned from its recv 31-48 us after
 * the agent's send when woken on the agent's CPU, 67-105 us on the other one, and the
 * scheduler chose the agent's CPU by itself in 28-55 of 57 requests, least often with the
 * other CPU idle. So while it waits it is bound to the CPU the agent last ran on, which the
 * agent, back from its sleep, usually runs on again (`wait_beside_agent`; 46-55 of 57), and
 * its own mask is back (`restore_own`) once the answer has left or the request goes to the
 * Python path: the binding is a hint for one wake-up, never a constraint on the work. Per
 * thread: each connection has its own. */
static __thread int bound;
static __thread cpu_set_t own_mask;

static void restore_own(void) {
    if (bound)
        sched_setaffinity(0, sizeof own_mask, &own_mask);
    bound = 0;
}

static void wait_beside_agent(long pid) {
    int cpu = last_cpu(pid);
    if (cpu < 0)
        return;
    /* Bound already (a later look): `own_mask` is the thread's own, kept from the first. */
    if (!bound && (sched_getaffinity(0, sizeof own_mask, &own_mask) != 0 ||
                   CPU_COUNT(&own_mask) < 2))
        return;
    if (!CPU_ISSET(cpu, &own_mask))
        return;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (sched_setaffinity(0, sizeof one, &one) == 0)
        bound = 1;
}

/* The agent's CPU is read right after an answer, but the agent then runs its step (its FUSE
 * requests wake it wherever a CPU is idle) and goes to sleep elsewhere about half the time on
 * an idle machine (traced: 16-20 of 38 paused requests found it on the other CPU, all 38 with
 * a busy loop beside). So the thread looks again once the step is likely over, twice, then
 * waits: two wake-ups in the agent's wait, never a poll. */
static void look_again_later(int fd, long pid) {
    static const int after_ms[] = {50, 1000};
    for (size_t i = 0; i < sizeof after_ms / sizeof after_ms[0] && bound; i++) {
        struct pollfd ready = {fd, POLLIN, 0};
        if (poll(&ready, 1, after_ms[i]) != 0)
            return; /* the request (or the end, an error, a signal): the recv sees which */
        wait_beside_agent(pid);
    }
}

/* After the answer has left on `fd`: the agent reads it now, and the bookkeeping runs after
 * it or elsewhere. Woken beside the agent, this thread yields its CPU to it, but with its
 * short slice (shadowfs.sched) a yield is not always enough: traced, the agent beside it read
 * its answer 9-10 us after it left in some runs and 150-230 us at the median in others, after
 * the whole bookkeeping. So while the answer is still unread in the socket it sleeps a moment
 * too (then: 22-36 us), and gets its own mask back after that, not before: that syscall would
 * be one more the agent waits for. */
static void let_agent_read(int fd) {
    sched_yield();
    int unread = 0;
    if (ioctl(fd, SIOCOUTQ, &unread) == 0 && unread > 0) {
        struct timespec moment = {0, 20000};
        nanosleep(&moment, NULL);
    }
    restore_own();
}

/* The locks on the path are `_thread.lock` and `_thread.RLock` objects (threading.Lock and
 * RLock). Taken through their Python methods, each `acquire(False)` after the agent's pause ran
 * the method lookup, an argument tuple and PyArg_ParseTupleAndKeywords from cold caches: the
 * three locks took 15-18 us of a paused checkpoint's ~210 (traced, docs/benchmarks.md). So on
 * the CPython this module is built for, whose lock objects are laid out as below
 * (Modules/_threadmodule.c), they are taken as those methods take them: the same
 * PyThread_acquire_lock_timed(lock, 0, 0) without blocking, the same fields set. The layout is
 * checked once at import against the methods themselves (`probe_locks`); any other type, or a
 * failed check, takes the methods. */
typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock_lock;
    PyObject *in_weakreflist;
    char locked;
} lock_layout;

typedef struct {
    PyObject_HEAD
    PyThread_type_lock rlock_lock;
    unsigned long rlock_owner;
    unsigned long rlock_count;
    PyObject *in_weakreflist;
} rlock_layout;

/* Set by `probe_locks` when the layouts above are the interpreter's. */
static PyTypeObject *lock_type, *rlock_type;

/* lock.acquire(False) through the method; 1 taken, 0 not (an error cleared). */
static int method_acquire(PyObject *lock) {
    PyObject *args[2] = {lock, Py_False};
    PyObject *got = PyObject_VectorcallMethod(s_acquire, args, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (got == NULL) {
        PyErr_Clear();
        return 0;
    }
    int taken = got == Py_True;
    Py_DECREF(got);
    return taken;
}

static void method_release(PyObject *lock) {
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_release);
    if (r == NULL)
        PyErr_Clear();
    Py_XDECREF(r);
}

/* lock.acquire(False), with the interpreter lock held; 1 taken, 0 not. */
static int try_acquire(PyObject *lock) {
    if (lock_type != NULL && Py_IS_TYPE(lock, lock_type)) {
        lock_layout *l = (lock_layout *)lock;
        if (PyThread_acquire_lock_timed(l->lock_lock, 0, 0) != PY_LOCK_ACQUIRED)
            return 0;
        l->locked = 1;
        return 1;
    }
    if (rlock_type != NULL && Py_IS_TYPE(lock, rlock_type)) {
        rlock_layout *r = (rlock_layout *)lock;
        unsigned long tid = PyThread_get_thread_ident();
        if (r->rlock_count > 0 && r->rlock_owner == tid) {
            if (r->rlock_count + 1 == 0)
                return 0;
            r->rlock_count++;
            return 1;
        }
        if (PyThread_acquire_lock_timed(r->rlock_lock, 0, 0) != PY_LOCK_ACQUIRED)
            return 0;
        r->rlock_owner = tid;
        r->rlock_count = 1;
        return 1;
    }
    return method_acquire(lock);
}

/* lock.release() of a lock `try_acquire` took, with the interpreter lock held. */
static void release(PyObject *lock) {
    if (lock_type != NULL && Py_IS_TYPE(lock, lock_type)) {
        lock_layout *l = (lock_layout *)lock;
        if (l->locked) {
            PyThread_release_lock(l->lock_lock);
            l->locked = 0;
        }
        return;
    }
    if (rlock_type != NULL && Py_IS_TYPE(lock, rlock_type)) {
        rlock_layout *r = (rlock_layout *)lock;
        if (r->rlock_count > 0 && r->rlock_owner == PyThread_get_thread_ident() &&
            --r->rlock_count == 0) {
            r->rlock_owner = 0;
            PyThread_release_lock(r->rlock_lock);
        }
        return;
    }
    method_release(lock);
}

/* Whether `lock` (a new lock of its type) is laid out as `lock_layout` (`rlock`: 0) or
 * `rlock_layout` (1): its fields must follow its own methods, and these functions' taking
 * and letting go must be seen by the methods (`locked()`, a second acquire). */
static int layout_holds(PyObject *lock, int rlock) {
    PyTypeObject *saved_lock = lock_type, *saved_rlock = rlock_type;
    int ok = 0;
    lock_type = rlock_type = NULL;
    if (!method_acquire(lock))
        goto done;
    if (rlock) {
        rlock_layout *r = (rlock_layout *)lock;
        ok = r->rlock_count == 1 && r->rlock_owner == PyThread_get_thread_ident() &&
             r->rlock_lock != NULL;
        method_release(lock);
        ok = ok && r->rlock_count == 0 && r->rlock_owner == 0;
        if (ok) {
            rlock_type = Py_TYPE(lock);
            ok = try_acquire(lock) && r->rlock_count == 1;
            rlock_type = NULL;
            /* The method sees it taken: its count goes to 2 and back. */
            ok = ok && method_acquire(lock) && r->rlock_count == 2;
            method_release(lock);
            method_release(lock);
            ok = ok && r->rlock_count == 0;
        }
    } else {
        lock_layout *l = (lock_layout *)lock;
        ok = l->locked == 1 && l->lock_lock != NULL;
        method_release(lock);
        ok = ok && l->locked == 0;
        if (ok) {
            lock_type = Py_TYPE(lock);
            ok = try_acquire(lock) && l->locked == 1;
            lock_type = NULL;
            /* Taken: the method cannot take it again, and lets it go. */
            ok = ok && !method_acquire(lock);
            method_release(lock);
            ok = ok && l->locked == 0 && method_acquire(lock);
            if (l->locked)
                method_release(lock);
        }
    }
done:
    lock_type = saved_lock;
    rlock_type = saved_rlock;
    if (PyErr_Occurred())
        PyErr_Clear();
    return ok;
}

/* `lock_type` and `rlock_type` set where the layouts hold for _thread's lock types. */
static void probe_locks(void) {
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030D0000
    PyObject *thread = PyImport_ImportModule("_thread");
    PyObject *lock = thread ? PyObject_CallMethod(thread, "allocate_lock", NULL) : NULL;
    PyObject *rlock = thread ? PyObject_CallMethod(thread, "RLock", NULL) : NULL;
    if (lock != NULL && layout_holds(lock, 0)) {
        lock_type = Py_TYPE(lock);
        Py_INCREF(lock_type);
    }
    if (rlock != NULL && layout_holds(rlock, 1)) {
        rlock_type = Py_TYPE(rlock);
        Py_INCREF(rlock_type);
    }
    Py_XDECREF(lock);
    Py_XDECREF(rlock);
    Py_XDECREF(thread);
#endif
    if (PyErr_Occurred())
        PyErr_Clear();
}

/* Where an attribute of one type's objects lives, found once per type (and again if the type
 * changes): after the agent's pause each PyObject_GetAttr ran the type's attribute lookup (its
 * method cache, its MRO) from cold caches. A `__slots__` attribute is then one load at its
 * offset; an attribute the type does not define at all (so the instance dict decides) one
 * lookup in that dict; anything else PyObject_GetAttr, as before. */
enum { ATTR_UNKNOWN, ATTR_SLOT, ATTR_DICT };

struct slot {
    PyTypeObject *type; /* the type `mode` was found for; NULL: none yet */
    unsigned int version;
    int mode;
    Py_ssize_t offset;
};

static int cache_holds(struct slot *cache, PyTypeObject *type) {
    return cache->type == type && cache->mode != ATTR_UNKNOWN &&
           (type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) && type->tp_version_tag == cache->version;
}

static void find_attr(struct slot *cache, PyTypeObject *type, PyObject *name) {
    cache->type = NULL;
    cache->mode = ATTR_UNKNOWN;
    PyObject *found = _PyType_Lookup(type, name); /* borrowed; gives the type a version */
    if (!(type->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG))
        return;
    if (found != NULL && Py_IS_TYPE(found, &PyMemberDescr_Type) &&
        PyType_IsSubtype(type, PyDescr_TYPE(found)) &&
        ((PyMemberDescrObject *)found)->d_member->type == T_OBJECT_EX) {
        cache->mode = ATTR_SLOT;
        cache->offset = ((PyMemberDescrObject *)found)->d_member->offset;
    } else if (found == NULL && type->tp_dictoffset != 0 && type->tp_getattro == PyObject_GenericGetAttr) {
        cache->mode = ATTR_DICT;
    } else {
        return;
    }
    cache->type = type;
    cache->version = type->tp_version_tag;
}

/* `obj.<name>` through `cache`: a borrowed reference (*owned 0), or a new one (*owned 1); NULL
 * (no error set) when there is none. */
static PyObject *slot_get(PyObject *obj, PyObject *name, struct slot *cache, int *owned) {
    PyTypeObject *type = Py_TYPE(obj);
    *owned = 0;
    if (!cache_holds(cache, type))
        find_attr(cache, type, name);
    if (cache->mode == ATTR_SLOT)
        return *(PyObject **)((char *)obj + cache->offset);
    if (cache->mode == ATTR_DICT) {
        /* The object's dict (made from its inline values the first time, by CPython's own
         * function, as `vars(obj)` would); absent there: no such attribute. */
        PyObject **dict = _PyObject_GetDictPtr(obj);
        if (dict != NULL && *dict != NULL && PyDict_CheckExact(*dict)) {
            PyObject *value = PyDict_GetItemWithError(*dict, name);
            if (value == NULL && PyErr_Occurred())
                PyErr_Clear();
            return value;
        }
        if (PyErr_Occurred())
            PyErr_Clear();
    }
    *owned = 1;
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        PyErr_Clear();
    return value;
}

/* `slot_get` as a new reference, or NULL (no error set). */
static PyObject *slot_ref(PyObject *obj, PyObject *name, struct slot *cache) {
    int owned;
    PyObject *value = slot_get(obj, name, cache, &owned);
    if (value != NULL && !owned)
        Py_INCREF(value);
    return value;
}

/* `obj.<name> = value` through `cache` (`slot_get`'s); -1 with an error set if it fails. */
static int slot_put(PyObject *obj, PyObject *name, struct slot *cache, PyObject *value) {
    if (!cache_holds(cache, Py_TYPE(obj)) || cache->mode != ATTR_SLOT)
        return PyObject_SetAttr(obj, name, value);
    Py_INCREF(value);
    Py_XSETREF(*(PyObject **)((char *)obj + cache->offset), value);
    return 0;
}

/* The attributes the compiled checkpoint reads, each with its own cache. */
static struct slot journal_changes, journal_count, node_dirty_names, layer_folded, layer_journal,
    layer_root, layer_last_tree, tape_lock, tape_error, tape_thread, tape_writer, tape_queue,
    writer_count, tape_in_flight, run_databases, run_checkpoints;

/* An attribute as a C long through its cache; -1 when absent or not an int. */
static long long slot_long(PyObject *obj, PyObject *name, struct slot *cache) {
    PyObject *v = slot_ref(obj, name, cache);
    if (v == NULL)
        return -1;
    long long r = PyLong_Check(v) ? PyLong_AsLongLong(v) : -1;
    Py_DECREF(v);
    if (r == -1 && PyErr_Occurred())
        PyErr_Clear();
    return r;
}

static void hex32(const char *raw, char *out) {
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        out[2 * i] = digits[((unsigned char)raw[i]) >> 4];
        out[2 * i + 1] = digits[((unsigned char)raw[i]) & 15];
    }
    out[64] = 0;
}

/* The layer's state says a checkpoint now would be the fold's marker (Layer.snapshot's
 * condition): new references to its tree and journal ids, else 0. Under the layer lock. */
static int folded_ids(PyObject *layer, PyObject **tree, PyObject **journal_id) {
    int ok = 0;
    PyObject *folded = NULL, *journal = NULL, *changes = NULL, *count = NULL, *root = NULL, *dirty = NULL;
    PyObject *last = NULL;
    folded = slot_ref(layer, s__folded_journal, &layer_folded);
    if (folded == NULL || !PyTuple_Check(folded) || PyTuple_GET_SIZE(folded) != 2)
        goto done;
    journal = slot_ref(layer, s_journal, &layer_journal);
    if (journal == NULL)
        goto done;
    /* The journal's and the nodes' are __slots__ attributes (`slot_get`). */
    changes = slot_ref(journal, s_changes, &journal_changes);
    if (changes == NULL || PyObject_RichCompareBool(PyTuple_GET_ITEM(folded, 0), changes, Py_EQ) != 1)
        goto done;
    count = slot_ref(journal, s__count, &journal_count);
    if (count == NULL || !PyLong_CheckExact(count) || _PyLong_Sign(count) <= 0)
        goto done;
    root = slot_ref(layer, s_root, &layer_root);
    if (root == NULL)
        goto done;
    dirty = slot_ref(root, s_dirty_names, &node_dirty_names);
    if (dirty == NULL || (PyAnySet_CheckExact(dirty) ? PySet_GET_SIZE(dirty) != 0 : PyObject_IsTrue(dirty) != 0))
        goto done;
    last = slot_ref(layer, s_last_tree, &layer_last_tree);
    PyObject *jid = PyTuple_GET_ITEM(folded, 1);
    if (last == NULL || !PyBytes_Check(last) || PyBytes_GET_SIZE(last) != 32 || !PyBytes_Check(jid) ||
        PyBytes_GET_SIZE(jid) != 32)
        goto done;
    *tree = last;
    last = NULL;
    Py_INCREF(jid);
    *journal_id = jid;
    ok = 1;
done:
    if (PyErr_Occurred())
        PyErr_Clear();
    Py_XDECREF(folded);
    Py_XDECREF(journal);
    Py_XDECREF(changes);
    Py_XDECREF(count);
    Py_XDECREF(root);
    Py_XDECREF(dirty);
    Py_XDECREF(last);
    return ok;
}

/* The checkpoint frame queued as GroupTape.append(defer=True) queues it, under its lock:
 * its seq, or -1 with nothing queued. */
static long long queue_frame(PyObject *tape, PyObject *payload, PyObject *journal_id, PyObject *tree) {
    long long seq = -1;
    PyObject *lock = slot_ref(tape, s__lock, &tape_lock);
    if (lock == NULL) {
        PyErr_Clear();
        return -1;
    }
    if (!try_acquire(lock)) {
        Py_DECREF(lock);
        return -1;
    }
    PyObject *error = NULL, *thread = NULL, *writer = NULL, *queue = NULL, *entry = NULL;
    PyObject *refs = NULL, *time_ns = NULL;
    error = slot_ref(tape, s__error, &tape_error);
    thread = slot_ref(tape, s__thread, &tape_thread);
    writer = slot_ref(tape, s_writer, &tape_writer);
    queue = slot_ref(tape, s__queue, &tape_queue);
    /* An earlier flush failed (append raises), or no flusher yet (append writes at once). */
    if (error != Py_None || thread == NULL || thread == Py_None || writer == NULL || queue == NULL ||
        !PyList_Check(queue))
        goto done;
    long long count = slot_long(writer, s__count, &writer_count);
    long long in_flight = slot_long(tape, s__in_flight, &tape_in_flight);
    if (count < 0 || in_flight < 0)
        goto done;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    refs = PyTuple_Pack(1, journal_id);
    time_ns = PyLong_FromLongLong((long long)now.tv_sec * 1000000000LL + now.tv_nsec);
    if (refs == NULL || time_ns == NULL)
        goto done;
    entry = PyTuple_Pack(6, s_checkpoint, payload, refs, tree, time_ns, Py_True);
    if (entry == NULL)
        goto done;
    long long at = count + in_flight + PyList_GET_SIZE(queue);
    if (PyList_Append(queue, entry) == 0)
        seq = at;
done:
    if (PyErr_Occurred())
        PyErr_Clear();
    release(lock);
    Py_DECREF(lock);
    Py_XDECREF(error);
    Py_XDECREF(thread);
    Py_XDECREF(writer);
    Py_XDECREF(queue);
    Py_XDECREF(entry);
    Py_XDECREF(refs);
    Py_XDECREF(time_ns);
    return seq;
}

/* `v` >= 0 in decimal at `p`; returns the end. */
static char *put_decimal(char *p, long long v) {
    char digits[20];
    int n = 0;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v > 0);
    while (n > 0)
        *p++ = digits[--n];
    return p;
}

static char *put(char *p, const char *s, size_t n) {
    memcpy(p, s, n);
    return p + n;
}

/* The answer line (`compiled_answer` reads it back), written out by hand: snprintf's code was
 * one more cold stretch on the path. Its length; `out` holds at least 256 bytes. */
static int answer_line(char *out, Py_ssize_t n, const char *tree_hex, long long seq) {
    static const char head[] = "{\"ok\":true,\"checkpoint\":";
    static const char mid[] = ",\"label\":null,\"tree\":\"";
    static const char tail[] = "\",\"frame\":";
    char *p = put(out, head, sizeof head - 1);
    p = put_decimal(p, n);
    p = put(p, mid, sizeof mid - 1);
    p = put(p, tree_hex, 64);
    p = put(p, tail, sizeof tail - 1);
    p = put_decimal(p, seq);
    p = put(p, "}\n", 2);
    return (int)(p - out);
}

/* `_Run._taken`'s payload for an unlabelled checkpoint the agent `peer` asked for, its number
 * and journal left None for `take` to set (the keys in the Python path's order), or NULL (no
 * error set). Made before the connection's wait, while this thread's caches are warm. */
static PyObject *fresh_payload(PyObject *peer) {
    PyObject *payload = PyDict_New(), *peer_copy = PyDict_Check(peer) ? PyDict_Copy(peer) : NULL;
    if (payload == NULL || peer_copy == NULL || PyDict_SetItem(payload, s_id, Py_None) ||
        PyDict_SetItem(payload, s_label, Py_None) || PyDict_SetItem(payload, s_reason, s_request) ||
        PyDict_SetItem(payload, s_journal, Py_None) || PyDict_SetItem(payload, s_peer, peer_copy)) {
        PyErr_Clear();
        Py_CLEAR(payload);
    }
    Py_XDECREF(peer_copy);
    return payload;
}

/* The checkpoint taken and answered, or NULL (no error set) with nothing done. `payload`:
 * `fresh_payload`'s, the frame's from here on. */
static PyObject *take(int fd, PyObject *gate, PyObject *payload) {
    /* Read as a tuple, not through PyArg_ParseTuple: its code is one more cold stretch. */
    if (!PyTuple_CheckExact(gate) || PyTuple_GET_SIZE(gate) != 6 || payload == NULL)
        return NULL;
    PyObject *turn = PyTuple_GET_ITEM(gate, 0), *run_lock = PyTuple_GET_ITEM(gate, 1);
    PyObject *run = PyTuple_GET_ITEM(gate, 2), *layer_lock = PyTuple_GET_ITEM(gate, 3);
    PyObject *layer = PyTuple_GET_ITEM(gate, 4), *tape = PyTuple_GET_ITEM(gate, 5);
    PyObject *held[3] = {turn, run_lock, layer_lock};
    int n_held = 0;
    for (; n_held < 3; n_held++)
        if (!try_acquire(held[n_held]))
            break;
    PyObject *tree = NULL, *journal_id = NULL, *result = NULL;
    PyObject *checkpoints = NULL, *databases = NULL, *number = NULL, *journal_str = NULL;
    if (n_held < 3)
        goto fail;
    /* A booth with databases checkpoints them first: the Python path's. */
    databases = slot_ref(run, s_databases, &run_databases);
    checkpoints = slot_ref(run, s_checkpoints, &run_checkpoints);
    if (databases != Py_None || checkpoints == NULL || !PyList_Check(checkpoints) ||
        !folded_ids(layer, &tree, &journal_id))
        goto fail;
    Py_ssize_t n = PyList_GET_SIZE(checkpoints);
    char tree_hex[65], journal_hex[65];
    hex32(PyBytes_AS_STRING(tree), tree_hex);
    hex32(PyBytes_AS_STRING(journal_id), journal_hex);
    number = PyLong_FromSsize_t(n);
    journal_str = PyUnicode_FromStringAndSize(journal_hex, 64);
    if (number == NULL || journal_str == NULL || PyDict_SetItem(payload, s_id, number) ||
        PyDict_SetItem(payload, s_journal, journal_str))
        goto fail;
    long long seq = queue_frame(tape, payload, journal_id, tree);
    if (seq < 0)
        goto fail;
    /* From here the checkpoint is taken: whatever the send does, the caller finishes it. */
    answered++;
    char out[256];
    int len = answer_line(out, n, tree_hex, seq);
    ssize_t sent;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    sent = send(fd, out, (size_t)len, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent < 0) {
        err = errno == EAGAIN || errno == EWOULDBLOCK ? 0 : errno;
        sent = 0;
    }
    /* The agent, beside this thread on its CPU (woken there by the agent's send), reads its
     * answer now, and the bookkeeping runs elsewhere or once the agent sleeps again. */
    let_agent_read(fd);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(nLOy#i)", n, seq, tree, out + sent, (Py_ssize_t)(len - sent), err);
    if (result == NULL) {
        /* Out of memory with the locks held and the frame queued: the caller must still
         * finish, so it hears at least the numbers. */
        PyErr_Clear();
        result = Py_BuildValue("(nLOy#i)", n, seq, tree, "", (Py_ssize_t)0, err);
    }
    Py_DECREF(tree);
    Py_DECREF(journal_id);
    Py_DECREF(checkpoints);
    Py_DECREF(databases);
    Py_DECREF(number);
    Py_DECREF(journal_str);
    return result;
fail:
    if (PyErr_Occurred())
        PyErr_Clear();
    while (n_held > 0)
        release(held[--n_held]);
    Py_XDECREF(tree);
    Py_XDECREF(journal_id);
    Py_XDECREF(checkpoints);
    Py_XDECREF(databases);
    Py_XDECREF(number);
    Py_XDECREF(journal_str);
    return NULL;
}

static PyObject *serve(PyObject *self, PyObject *args) {
    int fd;
    const char *line;
    Py_ssize_t line_len;
    PyObject *gate, *peer;
    int mount_fd = -1, fusectl_dir = -1;
    long key = 0;
    PyObject *locks = NULL;
    if (!PyArg_ParseTuple(args, "iy#OO", &fd, &line, &line_len, &gate, &peer))
        return NULL;
    if (gate != Py_None) {
        if (!PyArg_ParseTuple(gate, "iilO", &mount_fd, &fusectl_dir, &key, &locks)) {
            PyErr_Clear();
            gate = Py_None;
        }
    }
    long pid = -1;
    PyObject *payload = NULL;
    if (gate != Py_None) {
        PyObject *value = PyDict_Check(peer) ? PyDict_GetItemWithError(peer, s_pid) : NULL;
        pid = value != NULL && PyLong_Check(value) ? PyLong_AsLong(value) : -1;
        if (PyErr_Occurred()) {
            PyErr_Clear();
            pid = -1;
        }
        payload = fresh_payload(peer);
    }
    char *buf = PyMem_RawMalloc(BUFSIZE);
    if (buf == NULL) {
        Py_XDECREF(payload);
        return PyErr_NoMemory();
    }
    ssize_t n;
    int err = 0;
    long waiting = -1;
    int matched = 0, waiting_fd = -1;
    Py_BEGIN_ALLOW_THREADS
    if (gate != Py_None)
        waiting_fd = open_waiting(fusectl_dir);
    if (pid > 0) {
        wait_beside_agent(pid);
        look_again_later(fd, pid);
    }
    do {
        n = recv(fd, buf, BUFSIZE, 0);
    } while (n < 0 && errno == EINTR);
    if (n < 0)
        err = errno;
    matched = gate != Py_None && n == line_len && memcmp(buf, line, (size_t)n) == 0;
    /* Make the kernel's dirty pages reach the layer; none unanswered means they are in it. */
    if (matched && watched_syncfs(mount_fd, key) == 0)
        waiting = requests_waiting(waiting_fd);
    Py_END_ALLOW_THREADS
    if (n < 0) {
        if (waiting_fd >= 0)
            close(waiting_fd);
        restore_own();
        PyMem_RawFree(buf);
        Py_XDECREF(payload);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *done = matched && waiting == 0 ? take(fd, locks, payload) : NULL;
    Py_XDECREF(payload);
    /* After the answer has left: the close is no longer on the agent's way. */
    if (waiting_fd >= 0)
        close(waiting_fd);
    if (done != NULL) {
        PyMem_RawFree(buf);
        return done;
    }
    restore_own();
    PyObject *data = PyBytes_FromStringAndSize(buf, n);
    PyMem_RawFree(buf);
    return data;
}

/* Tasks running or runnable on the machine (/proc/loadavg's fourth field), 0 if unknown. */
static long runnable(void) {
    int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    char buf[128];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = buf;
    for (int field = 0; field < 3 && p != NULL; field++) {
        p = strchr(p, ' ');
        if (p != NULL)
            p++;
    }
    return p == NULL ? 0 : strtol(p, NULL, 10);
}

/* Digits at *p up to `stop` as a number (at most 18 of them), *p moved past; -1 if none. */
static long long digits_at(const char **p, char stop) {
    long long v = 0;
    int n = 0;
    while (**p >= '0' && **p <= '9' && n < 18) {
        v = v * 10 + (**p - '0');
        (*p)++;
        n++;
    }
    return n == 0 || **p != stop || (n > 1 && (*p)[-n] == '0') ? -1 : v;
}

/* An answer exactly as `take` writes it (and as the Python path encodes the same fields), and
 * nothing after it, as the dict `json` would make of it; NULL (no error set) for any other
 * bytes, which `_loads` then reads. */
static PyObject *compiled_answer(const char *buf, size_t have) {
    static const char head[] = "{\"ok\":true,\"checkpoint\":";
    static const char mid[] = ",\"label\":null,\"tree\":\"";
    static const char tail[] = "\",\"frame\":";
    if (have < 2 || buf[have - 1] != '\n' || memchr(buf, '\n', have - 1) != NULL)
        return NULL;
    const char *p = buf;
    if (strncmp(p, head, sizeof head - 1) != 0)
        return NULL;
    p += sizeof head - 1;
    long long n = digits_at(&p, ',');
    if (n < 0 || strncmp(p, mid, sizeof mid - 1) != 0)
        return NULL;
    p += sizeof mid - 1;
    for (int i = 0; i < 64; i++)
        if (!((p[i] >= '0' && p[i] <= '9') || (p[i] >= 'a' && p[i] <= 'f')))
            return NULL;
    const char *tree = p;
    p += 64;
    if (strncmp(p, tail, sizeof tail - 1) != 0)
        return NULL;
    p += sizeof tail - 1;
    long long seq = digits_at(&p, '}');
    if (seq < 0 || p + 2 != buf + have)
        return NULL;
    /* Built item by item with interned keys: Py_BuildValue's format walk and its five new
     * key strings ran cold in the agent after its pause. */
    PyObject *answer = PyDict_New(), *number = PyLong_FromLongLong(n);
    PyObject *tree_str = PyUnicode_FromStringAndSize(tree, 64), *frame = PyLong_FromLongLong(seq);
    if (answer == NULL || number == NULL || tree_str == NULL || frame == NULL ||
        PyDict_SetItem(answer, s_ok, Py_True) || PyDict_SetItem(answer, s_checkpoint, number) ||
        PyDict_SetItem(answer, s_label, Py_None) || PyDict_SetItem(answer, s_tree, tree_str) ||
        PyDict_SetItem(answer, s_frame, frame))
        Py_CLEAR(answer);
    Py_XDECREF(number);
    Py_XDECREF(tree_str);
    Py_XDECREF(frame);
    return answer;
}

/* A send or recv interrupted by a signal: its Python handler runs now, with the interpreter
 * lock taken back from `*save` and given up again, as it would in socket.send and recv (PEP
 * 475), so Ctrl-C does not wait for the booth's answer. True when the handler raised. */
static int signal_raised(PyThreadState **save) {
    PyEval_RestoreThread(*save);
    int raised = PyErr_CheckSignals() < 0;
    *save = PyEval_SaveThread();
    return raised;
}

/* What `exchange` did: the answer's bytes, and how the send and the read ended. */
struct exchanged {
    char buf[4096];
    size_t have;
    int send_err, recv_err, polls_after, interrupted;
};

/* `line` sent on `fd` and its answer read into `x`, as `ask` describes, without the
 * interpreter lock (taken back only for a signal's handler). */
static void exchange(int fd, const char *line, Py_ssize_t line_len, double spin, int polls, int cpus,
                     struct exchanged *x) {
    char *buf = x->buf;
    size_t have = 0;
    int send_err = 0, recv_err = 0, polls_after = polls, interrupted = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t off = 0;
    while (off < line_len) {
        ssize_t n = send(fd, line + off, (size_t)(line_len - off), MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) {
                if (!signal_raised(&_save))
                    continue;
                interrupted = 1;
            }
            send_err = errno;
            break;
        }
        off += n;
    }
    if (!send_err) {
        double started = monotonic();
        int newline = 0;
        if (spin > 0 && polls) {
            int looked = 0;
            while (have < sizeof x->buf) {
                ssize_t n = recv(fd, buf + have, sizeof x->buf - have, MSG_DONTWAIT);
                if (n > 0) {
                    newline = memchr(buf + have, '\n', (size_t)n) != NULL;
                    have += (size_t)n;
                    if (newline)
                        break;
                    continue;
                }
                if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
                    break;
                if (!looked) {
                    looked = 1;
                    if (runnable() > cpus)
                        break;
                }
                if (monotonic() - started > spin)
                    break;
                sched_yield();
            }
            polls_after = newline;
        }
        while (!newline && have < sizeof x->buf) {
            ssize_t n = recv(fd, buf + have, sizeof x->buf - have, 0);
            if (n == 0) {
                recv_err = -1;
                break;
            }
            if (n < 0) {
                if (errno == EINTR) {
                    if (!signal_raised(&_save))
                        continue;
                    interrupted = 1;
                }
                recv_err = errno;
                break;
            }
            newline = memchr(buf + have, '\n', (size_t)n) != NULL;
            have += (size_t)n;
        }
        if (spin > 0 && !polls && newline)
            polls_after = monotonic() - started <= spin;
    }
    Py_END_ALLOW_THREADS
    x->have = have;
    x->send_err = send_err;
    x->recv_err = recv_err;
    x->polls_after = polls_after;
    x->interrupted = interrupted;
}

/* (the answer, polls for the next request, errno of the read) of a read `exchange` did: the
 * answer as a dict when it is a compiled checkpoint answer, else the bytes read. */
static PyObject *outcome(struct exchanged *x) {
    PyObject *answer = compiled_answer(x->buf, x->have);
    if (answer == NULL && PyErr_Occurred())
        return NULL;
    if (answer == NULL)
        answer = PyBytes_FromStringAndSize(x->buf, (Py_ssize_t)x->have);
    if (answer == NULL)
        return NULL;
    return Py_BuildValue("(NOi)", answer, x->polls_after ? Py_True : Py_False, x->recv_err);
}

/* The agent's side: `ControlClient.ask_compiled`, a request line sent and its answer read as
 * `ControlClient.answer` reads it (polled for up to `spin` seconds when `polls`, unless more
 * tasks are runnable than `cpus`), without the interpreter lock and its cold frames. Returns
 * (the answer, polls for the next request, errno of the read: 0, or -1 for the end of the
 * stream), the answer as a dict when it is a compiled checkpoint answer (`compiled_answer`),
 * else the bytes read; an error of the send raises OSError (the request did not go out whole).
 */
static PyObject *ask(PyObject *self, PyObject *args) {
    int fd, polls, cpus;
    const char *line;
    Py_ssize_t line_len;
    double spin;
    if (!PyArg_ParseTuple(args, "iy#dpi", &fd, &line, &line_len, &spin, &polls, &cpus))
        return NULL;
    struct exchanged x;
    exchange(fd, line, line_len, spin, polls, cpus, &x);
    if (x.interrupted)
        return NULL; /* the handler's exception */
    if (x.send_err) {
        errno = x.send_err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return outcome(&x);
}

/* The key `kept` holds the client of $JUKEBOX_SOCKET under (os.environ's decoding of the
 * value), kept for the value it was made of: decoding it and hashing the new string ran cold at
 * every request. Changed with the interpreter lock held. */
static char key_path[4096];
static size_t key_len;
static PyObject *key_str;

static PyObject *key_of(const char *path) {
    size_t len = strlen(path);
    if (key_str != NULL && len == key_len && memcmp(path, key_path, len) == 0) {
        Py_INCREF(key_str);
        return key_str;
    }
    PyObject *key = PyUnicode_DecodeFSDefault(path);
    if (key == NULL || len >= sizeof key_path)
        return key;
    Py_XSETREF(key_str, key);
    Py_INCREF(key);
    memcpy(key_path, path, len);
    key_len = len;
    return key;
}

/* ControlClient's __slots__ (`slot_get`). */
static struct slot client_timeout, client_buf, client_polls, client_sock;

/* The kept client of `kept` (control._kept) for $JUKEBOX_SOCKET, if `ask` may use it now: set
 * and not empty, the client's timeout `timeout`, nothing of an earlier answer buffered, its
 * socket open: a new reference (NULL, no error set: not now), and its fd and poll flag.
 * With the interpreter lock held, as os.environ's putenv is: getenv sees what it set. */
static PyObject *kept_client(PyObject *kept, double timeout, PyObject **key, int *fd, int *polls) {
    const char *path = getenv("JUKEBOX_SOCKET");
    PyObject *client = NULL, *value = NULL, *sock = NULL;
    *key = NULL;
    if (path == NULL || path[0] == 0 || !PyDict_Check(kept))
        return NULL;
    *key = key_of(path);
    if (*key == NULL)
        goto fail;
    client = PyDict_GetItemWithError(kept, *key);
    if (client == NULL)
        goto fail;
    Py_INCREF(client);
    value = slot_ref(client, s_timeout, &client_timeout);
    if (value == NULL || !PyFloat_CheckExact(value) || PyFloat_AS_DOUBLE(value) != timeout)
        goto fail;
    Py_DECREF(value);
    value = slot_ref(client, s__buf, &client_buf);
    if (value == NULL || !PyBytes_CheckExact(value) || PyBytes_GET_SIZE(value) != 0)
        goto fail;
    Py_DECREF(value);
    value = slot_ref(client, s_polls, &client_polls);
    if (value == NULL || (*polls = PyObject_IsTrue(value)) < 0)
        goto fail;
    Py_DECREF(value);
    sock = slot_ref(client, s_sock, &client_sock);
    value = sock == NULL ? NULL : PyObject_CallMethodNoArgs(sock, s_fileno);
    if (value == NULL || !PyLong_Check(value) || (*fd = PyLong_AsLong(value)) < 0)
        goto fail;
    Py_DECREF(value);
    Py_DECREF(sock);
    return client;
fail:
    if (PyErr_Occurred())
        PyErr_Clear();
    Py_XDECREF(value);
    Py_XDECREF(sock);
    Py_XDECREF(client);
    Py_CLEAR(*key);
    return NULL;
}

/* `request({"op": "checkpoint"})` with the default path and timeout, from its first bytecode
 * after the lock to the answer in one call (control.request, under `_kept_lock`): the kept
 * connection for $JUKEBOX_SOCKET found and asked (`kept_client`, `exchange`). Returns None
 * with nothing sent (no such client: `request`'s Python path does what it always did), the
 * answer's dict (a compiled checkpoint answer; the client's poll flag updated), or (the
 * client's key in `kept`, the client, what `ask` would have returned or the send's errno) for
 * `request` to finish as after `ask`. A signal's exception ends the request here: the connection, out of step, is closed
 * and forgotten first, as `request` does for any failure. */
static PyObject *ask_kept_with(PyObject *kept, PyObject *line_bytes, double timeout, double spin,
                               int cpus) {
    const char *line = PyBytes_AS_STRING(line_bytes);
    Py_ssize_t line_len = PyBytes_GET_SIZE(line_bytes);
    int fd = -1, polls = 0;
    PyObject *key;
    PyObject *client = kept_client(kept, timeout, &key, &fd, &polls);
    if (client == NULL)
        Py_RETURN_NONE;
    struct exchanged x;
    exchange(fd, line, line_len, spin, polls, cpus, &x);
    PyObject *result = NULL;
    if (x.interrupted) {
        /* the handler's exception, below */
    } else if (x.send_err) {
        result = Py_BuildValue("(OOi)", key, client, x.send_err);
    } else {
        /* The compiled answer straight to the caller, no tuple on the way (`outcome`). */
        PyObject *answer = compiled_answer(x.buf, x.have);
        if (answer != NULL &&
            slot_put(client, s_polls, &client_polls, x.polls_after ? Py_True : Py_False) == 0) {
            result = answer;
        } else {
            Py_XDECREF(answer);
            PyErr_Clear();
            PyObject *got = outcome(&x);
            if (got != NULL)
                result = Py_BuildValue("(OON)", key, client, got);
        }
    }
    if (result == NULL) {
        /* A signal's exception, or no memory left, with the request sent. */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *closed = PyObject_CallMethodNoArgs(client, s_close);
        Py_XDECREF(closed);
        if (PyDict_GetItemWithError(kept, key) == client)
            PyDict_DelItem(kept, key);
        if (PyErr_Occurred())
            PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
    Py_DECREF(client);
    Py_DECREF(key);
    return result;
}

/* `cpus` as a C int, or -1 with an error set. */
static int as_cpus(PyObject *cpus) {
    long n = PyLong_AsLong(cpus);
    if (n == -1 && PyErr_Occurred())
        return -1;
    return n < 1 ? 1 : n > 1 << 20 ? 1 << 20 : (int)n;
}

static PyObject *ask_kept(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    /* Its five arguments read one by one (a fast call): PyArg_ParseTuple's code ran cold. */
    if (nargs != 5 || !PyBytes_Check(args[1]) || !PyFloat_Check(args[2]) || !PyFloat_Check(args[3]) ||
        !PyLong_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "ask_kept(kept, line: bytes, timeout: float, spin: float, cpus: int)");
        return NULL;
    }
    int cpus = as_cpus(args[4]);
    if (cpus < 0)
        return NULL;
    return ask_kept_with(args[0], args[1], PyFloat_AS_DOUBLE(args[2]), PyFloat_AS_DOUBLE(args[3]), cpus);
}

/* `control.request` itself, where this module is built: `request(request, path=None,
 * timeout=30.0)`. The unlabelled checkpoint an agent asks for after each step, called as
 * `request({"op": "checkpoint"})`, goes from the agent's call to its send without a Python
 * frame: traced after the agent's pause, `request`'s own bytecodes, its `with _kept_lock`
 * (the lock's __enter__ parses its arguments) and its global lookups were 15-18 us of the
 * 24 before `ask_kept`. Here: the argument's one key compared, `_kept_lock` (the module's
 * current one: a fork makes a new one) taken without waiting, and `ask_kept`'s work; an
 * answer to finish goes to the module's `_request_kept` under the same lock, as `request`
 * does. Any other call, a lock another thread holds, or no kept client yet: the Python
 * function (`fallback`), unchanged. */
typedef struct {
    PyObject_HEAD
    PyObject *fallback;  /* the Python `request` */
    PyObject *globals;   /* its module's dict: `_kept_lock`, SPIN, _CPUS, `_request_kept` */
    PyObject *kept;      /* `_kept`, never rebound */
    PyObject *line;      /* CHECKPOINT_LINE */
    vectorcallfunc vectorcall;
} QuickRequest;

/* Whether `arg` is exactly {"op": "checkpoint"} as `request == _CHECKPOINT` sees it: a dict
 * of one key "op" whose value is the str "checkpoint". -1 with an error set. */
static int is_plain_checkpoint(PyObject *arg) {
    if (!PyDict_CheckExact(arg) || PyDict_GET_SIZE(arg) != 1)
        return 0;
    PyObject *op = PyDict_GetItemWithError(arg, s_op);
    if (op == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return PyUnicode_CheckExact(op) && PyUnicode_Compare(op, s_checkpoint) == 0;
}

static PyObject *quick_request_call(PyObject *callable, PyObject *const *args, size_t nargsf,
                                    PyObject *kwnames) {
    QuickRequest *self = (QuickRequest *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs == 1 && kwnames == NULL) {
        int plain = is_plain_checkpoint(args[0]);
        if (plain < 0)
            return NULL;
        PyObject *lock = plain ? PyDict_GetItemWithError(self->globals, s__kept_lock) : NULL;
        if (lock == NULL && PyErr_Occurred())
            return NULL;
        if (lock != NULL) {
            Py_INCREF(lock);
            /* SPIN and _CPUS as the module has them now (a test may set them). */
            PyObject *spin = PyDict_GetItemWithError(self->globals, s_SPIN);
            PyObject *cpus = PyDict_GetItemWithError(self->globals, s__CPUS);
            int n_cpus = cpus != NULL && PyLong_CheckExact(cpus) ? as_cpus(cpus) : -1;
            if (PyErr_Occurred()) {
                Py_DECREF(lock);
                return NULL;
            }
            if (spin == NULL || !PyFloat_CheckExact(spin) || n_cpus < 0) {
                Py_DECREF(lock); /* not as the module defines them: the Python function */
            } else if (try_acquire(lock)) {
                PyObject *asked = ask_kept_with(self->kept, self->line, 30.0, PyFloat_AS_DOUBLE(spin), n_cpus);
                PyObject *result = asked;
                if (asked != NULL && PyTuple_CheckExact(asked) && PyTuple_GET_SIZE(asked) == 3) {
                    /* `request`'s `_request_kept(request, key, timeout, (client, asked))` */
                    PyObject *finish = PyDict_GetItemWithError(self->globals, s__request_kept);
                    PyObject *rest = PyTuple_GetSlice(asked, 1, 3);
                    result = finish == NULL || rest == NULL ? NULL :
                        PyObject_CallFunction(finish, "OOdO", args[0], PyTuple_GET_ITEM(asked, 0),
                                              30.0, rest);
                    if (result == NULL && !PyErr_Occurred())
                        PyErr_SetString(PyExc_RuntimeError, "control._request_kept is missing");
                    Py_XDECREF(rest);
                    Py_DECREF(asked);
                }
                release(lock);
                Py_DECREF(lock);
                if (result != Py_None)
                    return result; /* the answer, or the exception */
                Py_DECREF(result); /* nothing sent: the Python function serves it */
            } else {
                Py_DECREF(lock);
            }
        }
    }
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

static int quick_request_traverse(PyObject *op, visitproc visit, void *arg) {
    QuickRequest *self = (QuickRequest *)op;
    Py_VISIT(self->fallback);
    Py_VISIT(self->globals);
    Py_VISIT(self->kept);
    Py_VISIT(self->line);
    return 0;
}

static int quick_request_clear(PyObject *op) {
    QuickRequest *self = (QuickRequest *)op;
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->globals);
    Py_CLEAR(self->kept);
    Py_CLEAR(self->line);
    return 0;
}

static void quick_request_dealloc(PyObject *op) {
    PyObject_GC_UnTrack(op);
    quick_request_clear(op);
    Py_TYPE(op)->tp_free(op);
}

/* Looked up on the Python function, so help(), inspect.signature and `__name__` see it. */
static PyObject *quick_request_getattro(PyObject *op, PyObject *name) {
    PyObject *found = PyObject_GenericGetAttr(op, name);
    if (found != NULL || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return found;
    PyErr_Clear();
    return PyObject_GetAttr(((QuickRequest *)op)->fallback, name);
}

static PyObject *quick_request_doc(PyObject *op, void *unused) {
    return PyObject_GetAttrString(((QuickRequest *)op)->fallback, "__doc__");
}

static PyGetSetDef quick_request_getset[] = {
    {"__doc__", quick_request_doc, NULL, NULL, NULL},
    {NULL},
};

static PyMemberDef quick_request_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(QuickRequest, fallback), READONLY, NULL},
    {NULL},
};

static PyTypeObject QuickRequestType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "jukebox.booth._quickline.QuickRequest",
    .tp_basicsize = sizeof(QuickRequest),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(QuickRequest, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = quick_request_traverse,
    .tp_clear = quick_request_clear,
    .tp_dealloc = quick_request_dealloc,
    .tp_getattro = quick_request_getattro,
    .tp_members = quick_request_members,
    .tp_getset = quick_request_getset,
};

/* quick_request(fallback, globals, kept, line) -> a QuickRequest. */
static PyObject *quick_request(PyObject *module, PyObject *args) {
    PyObject *fallback, *globals, *kept, *line;
    if (!PyArg_ParseTuple(args, "OO!O!O!", &fallback, &PyDict_Type, &globals, &PyDict_Type, &kept,
                          &PyBytes_Type, &line))
        return NULL;
    QuickRequest *self = PyObject_GC_New(QuickRequest, &QuickRequestType);
    if (self == NULL)
        return NULL;
    Py_INCREF(fallback);
    Py_INCREF(globals);
    Py_INCREF(kept);
    Py_INCREF(line);
    self->fallback = fallback;
    self->globals = globals;
    self->kept = kept;
    self->line = line;
    self->vectorcall = quick_request_call;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static PyObject *syncing(PyObject *self, PyObject *arg) {
    long key = PyLong_AsLong(arg);
    if (key == -1 && PyErr_Occurred())
        return NULL;
    double oldest = 0;
    pthread_mutex_lock(&slots_mutex);
    for (int i = 0; i < SLOTS; i++)
        if (slots[i].since != 0 && slots[i].key == key && (oldest == 0 || slots[i].since < oldest))
            oldest = slots[i].since;
    pthread_mutex_unlock(&slots_mutex);
    if (oldest == 0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(oldest);
}

/* Whether the locks are taken directly (`try_acquire`): (threading.Lock, threading.RLock). */
static PyObject *direct_locks(PyObject *self, PyObject *unused) {
    return Py_BuildValue("(OO)", lock_type != NULL ? Py_True : Py_False,
                         rlock_type != NULL ? Py_True : Py_False);
}

static PyObject *answered_count(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(answered);
}

static PyMethodDef methods[] = {
    {"serve", serve, METH_VARARGS,
     "serve(fd, line, gate, peer) -> bytes read, or (n, seq, tree, rest, errno) once answered"},
    {"ask", ask, METH_VARARGS,
     "ask(fd, line, spin, polls, cpus) -> (answer dict or bytes read, polls, errno of the read)"},
    {"ask_kept", (PyCFunction)(void (*)(void))ask_kept, METH_FASTCALL,
     "ask_kept(kept, line, timeout, spin, cpus) -> None, the answer's dict, or (key, client, asked)"},
    {"quick_request", quick_request, METH_VARARGS,
     "quick_request(fallback, globals, kept, line) -> control.request, compiled"},
    {"syncing", syncing, METH_O, "syncing(key) -> when the oldest syncfs of key began, or None"},
    {"answered", answered_count, METH_NOARGS, "answered() -> checkpoints this module answered"},
    {"direct_locks", direct_locks, METH_NOARGS,
     "direct_locks() -> whether (Lock, RLock) are taken without their methods"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_quickline",
    "The booth's quick checkpoint line answered in C (see _quickline.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__quickline(void) {
#define INTERN(name) \
    if ((s_##name = PyUnicode_InternFromString(#name)) == NULL) \
        return NULL;
    NAMES(INTERN)
#undef INTERN
    probe_locks();
    if (PyType_Ready(&QuickRequestType) < 0)
        return NULL;
    return PyModule_Create(&module);
}
