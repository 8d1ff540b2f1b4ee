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
 * by their C methods without blocking, in the order the Python path takes them: the control
 * server's turn, the run's lock, the layer lock, then the tape queue's lock for the frame.
 * The state is read from the same objects the Python path reads: the layer's
 * `_folded_journal`, `journal.changes`, `journal._count`, `root.dirty_names`, `last_tree`
 * (shadowfs.layer.Layer.snapshot's marker condition) and the tape queue's `_count`,
 * `_in_flight`, `_queue`, `_error`, `_thread` (jukebox.booth.supervisor.GroupTape.append).
 *
 * The syncfs can wait on the layer's workers, which the booth's watchdog must be able to see
 * (jukebox.booth.layer_watchdog): `syncing(key)` gives when the oldest syncfs of `key` (the
 * fusectl connection number) began, in time.monotonic() seconds, or None.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

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
    X(fileno) X(close) X(pid)
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

/* lock.acquire(False); 1 taken, 0 not (an error cleared). */
static int try_acquire(PyObject *lock) {
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

static void release(PyObject *lock) {
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_release);
    if (r == NULL)
        PyErr_Clear();
    Py_XDECREF(r);
}

/* An attribute as a C long; -1 with no error set when absent or not an int. */
static long long attr_long(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) {
        PyErr_Clear();
        return -1;
    }
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
    PyObject *folded = NULL, *journal = NULL, *changes = NULL, *root = NULL, *dirty = NULL;
    PyObject *last = NULL;
    folded = PyObject_GetAttr(layer, s__folded_journal);
    if (folded == NULL || !PyTuple_Check(folded) || PyTuple_GET_SIZE(folded) != 2)
        goto done;
    journal = PyObject_GetAttr(layer, s_journal);
    if (journal == NULL)
        goto done;
    changes = PyObject_GetAttr(journal, s_changes);
    if (changes == NULL || PyObject_RichCompareBool(PyTuple_GET_ITEM(folded, 0), changes, Py_EQ) != 1)
        goto done;
    if (attr_long(journal, s__count) <= 0)
        goto done;
    root = PyObject_GetAttr(layer, s_root);
    if (root == NULL)
        goto done;
    dirty = PyObject_GetAttr(root, s_dirty_names);
    if (dirty == NULL || PyObject_IsTrue(dirty) != 0)
        goto done;
    last = PyObject_GetAttr(layer, s_last_tree);
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
    Py_XDECREF(root);
    Py_XDECREF(dirty);
    Py_XDECREF(last);
    return ok;
}

/* The checkpoint frame queued as GroupTape.append(defer=True) queues it, under its lock:
 * its seq, or -1 with nothing queued. */
static long long queue_frame(PyObject *tape, PyObject *payload, PyObject *journal_id, PyObject *tree) {
    long long seq = -1;
    PyObject *lock = PyObject_GetAttr(tape, s__lock);
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
    error = PyObject_GetAttr(tape, s__error);
    thread = PyObject_GetAttr(tape, s__thread);
    writer = PyObject_GetAttr(tape, s_writer);
    queue = PyObject_GetAttr(tape, s__queue);
    /* An earlier flush failed (append raises), or no flusher yet (append writes at once). */
    if (error != Py_None || thread == NULL || thread == Py_None || writer == NULL || queue == NULL ||
        !PyList_Check(queue))
        goto done;
    long long count = attr_long(writer, s__count);
    long long in_flight = attr_long(tape, s__in_flight);
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

/* The checkpoint taken and answered, or NULL (no error set) with nothing done. */
static PyObject *take(int fd, PyObject *gate, PyObject *peer) {
    PyObject *turn, *run_lock, *run, *layer_lock, *layer, *tape;
    if (!PyArg_ParseTuple(gate, "OOOOOO", &turn, &run_lock, &run, &layer_lock, &layer, &tape) ||
        !PyDict_Check(peer)) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *held[3] = {turn, run_lock, layer_lock};
    int n_held = 0;
    for (; n_held < 3; n_held++)
        if (!try_acquire(held[n_held]))
            break;
    PyObject *tree = NULL, *journal_id = NULL, *payload = NULL, *peer_copy = NULL, *result = NULL;
    PyObject *checkpoints = NULL, *databases = NULL, *number = NULL, *journal_str = NULL;
    if (n_held < 3)
        goto fail;
    /* A booth with databases checkpoints them first: the Python path's. */
    databases = PyObject_GetAttr(run, s_databases);
    checkpoints = PyObject_GetAttr(run, s_checkpoints);
    if (databases != Py_None || checkpoints == NULL || !PyList_Check(checkpoints) ||
        !folded_ids(layer, &tree, &journal_id))
        goto fail;
    Py_ssize_t n = PyList_GET_SIZE(checkpoints);
    char tree_hex[65], journal_hex[65];
    hex32(PyBytes_AS_STRING(tree), tree_hex);
    hex32(PyBytes_AS_STRING(journal_id), journal_hex);
    /* `_Run._taken`'s payload for an unlabelled checkpoint the agent asked for. */
    peer_copy = PyDict_Copy(peer);
    if (peer_copy == NULL)
        goto fail;
    number = PyLong_FromSsize_t(n);
    journal_str = PyUnicode_FromStringAndSize(journal_hex, 64);
    payload = PyDict_New();
    if (number == NULL || journal_str == NULL || payload == NULL ||
        PyDict_SetItem(payload, s_id, number) || PyDict_SetItem(payload, s_label, Py_None) ||
        PyDict_SetItem(payload, s_reason, s_request) ||
        PyDict_SetItem(payload, s_journal, journal_str) || PyDict_SetItem(payload, s_peer, peer_copy))
        goto fail;
    long long seq = queue_frame(tape, payload, journal_id, tree);
    if (seq < 0)
        goto fail;
    /* From here the checkpoint is taken: whatever the send does, the caller finishes it. */
    answered++;
    char out[256];
    int len = snprintf(
        out, sizeof out, "{\"ok\":true,\"checkpoint\":%zd,\"label\":null,\"tree\":\"%s\",\"frame\":%lld}\n",
        n, tree_hex, seq);
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
    Py_DECREF(payload);
    Py_DECREF(peer_copy);
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
    Py_XDECREF(payload);
    Py_XDECREF(peer_copy);
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
    if (gate != Py_None) {
        PyObject *value = PyDict_Check(peer) ? PyDict_GetItemWithError(peer, s_pid) : NULL;
        pid = value != NULL && PyLong_Check(value) ? PyLong_AsLong(value) : -1;
        if (PyErr_Occurred()) {
            PyErr_Clear();
            pid = -1;
        }
    }
    char *buf = PyMem_RawMalloc(BUFSIZE);
    if (buf == NULL)
        return PyErr_NoMemory();
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
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *done = matched && waiting == 0 ? take(fd, locks, peer) : NULL;
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
    return Py_BuildValue(
        "{s:O,s:L,s:O,s:s#,s:L}", "ok", Py_True, "checkpoint", n, "label", Py_None, "tree", tree,
        (Py_ssize_t)64, "frame", seq);
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
    /* os.environ's decoding of the value: the key `request` keeps the client under. */
    *key = PyUnicode_DecodeFSDefault(path);
    if (*key == NULL)
        goto fail;
    client = PyDict_GetItemWithError(kept, *key);
    if (client == NULL)
        goto fail;
    Py_INCREF(client);
    value = PyObject_GetAttr(client, s_timeout);
    if (value == NULL || !PyFloat_CheckExact(value) || PyFloat_AS_DOUBLE(value) != timeout)
        goto fail;
    Py_DECREF(value);
    value = PyObject_GetAttr(client, s__buf);
    if (value == NULL || !PyBytes_CheckExact(value) || PyBytes_GET_SIZE(value) != 0)
        goto fail;
    Py_DECREF(value);
    value = PyObject_GetAttr(client, s_polls);
    if (value == NULL || (*polls = PyObject_IsTrue(value)) < 0)
        goto fail;
    Py_DECREF(value);
    sock = PyObject_GetAttr(client, s_sock);
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
static PyObject *ask_kept(PyObject *self, PyObject *args) {
    PyObject *kept;
    const char *line;
    Py_ssize_t line_len;
    double timeout, spin;
    int cpus, fd = -1, polls = 0;
    if (!PyArg_ParseTuple(args, "Oy#ddi", &kept, &line, &line_len, &timeout, &spin, &cpus))
        return NULL;
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
        PyObject *got = outcome(&x);
        if (got != NULL && PyDict_CheckExact(PyTuple_GET_ITEM(got, 0)) &&
            PyObject_SetAttr(client, s_polls, PyTuple_GET_ITEM(got, 1)) == 0) {
            result = PyTuple_GET_ITEM(got, 0);
            Py_INCREF(result);
            Py_DECREF(got);
        } else if (got != NULL) {
            PyErr_Clear();
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

static PyObject *answered_count(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(answered);
}

static PyMethodDef methods[] = {
    {"serve", serve, METH_VARARGS,
     "serve(fd, line, gate, peer) -> bytes read, or (n, seq, tree, rest, errno) once answered"},
    {"ask", ask, METH_VARARGS,
     "ask(fd, line, spin, polls, cpus) -> (answer dict or bytes read, polls, errno of the read)"},
    {"ask_kept", ask_kept, METH_VARARGS,
     "ask_kept(kept, line, timeout, spin, cpus) -> None, the answer's dict, or (key, client, asked)"},
    {"syncing", syncing, METH_O, "syncing(key) -> when the oldest syncfs of key began, or None"},
    {"answered", answered_count, METH_NOARGS, "answered() -> checkpoints this module answered"},
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
    return PyModule_Create(&module);
}
