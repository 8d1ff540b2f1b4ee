/* The per-file system calls of a big commit (shadowfs.commit), a batch per call with the
 * interpreter lock released once.
 *
 * Why: a commit of 50,000 files stages 50,000 files (open, write, futimens, close), stats
 * every path again once its journal is written, then links each file it replaces into its
 * trash and renames the staged file over it. Made from Python, each of those 350,000 calls
 * lets go of the interpreter lock and takes it back, and the commit's 16 threads and its main
 * thread (reading the next files from the store) queue for it. Here a thread takes a slice of
 * a chunk in one call and lets go of the lock once for all of it (docs/benchmarks.md, "The
 * commit's per-file calls in batches").
 *
 * The calls are the very ones the Python path makes, in the same order, with the same flags;
 * shadowfs.commit keeps that path (`_write_staged`, `_fast_op`) for when this module is not
 * built and with SHADOWFS_BATCHIO=off, and decides everything else (what to stage, where,
 * what a failure means) itself.
 *
 * `write_files(calls)`: each call (dir_fd, name, data, mode, mtime_ns, direct) creates `name`
 * in `dir_fd` (O_WRONLY|O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC, mode `mode` when `direct`, else
 * 0600 and an fchmod to `mode` after the data), writes `data` whole, sets its atime and mtime
 * to `mtime_ns` and closes it. Stops at the first failure, raising OSError (errno, the name):
 * the files before it stay staged, as the Python path leaves them, for the caller to undo.
 *
 * `keep_and_rename(calls, die_at)`: each call (trash_fd, trash_name, src_fd, src_name, dst_fd,
 * dst_name) links what is at `dst_name` into the trash (EEXIST counts as linked: a previous
 * run's link), then renames `src_name` over `dst_name`. Returns bytes, one per call: 1 done,
 * 0 when the rename failed (the caller runs that operation again with all its checks). The
 * link may fail (nothing there, a directory): the rename then runs all the same, as in
 * `_fast_op`. `die_at` >= 0: the process SIGKILLs itself once that call's file is linked into
 * the trash (the crash tests' `aside:K`), with the lock released and the earlier calls done.
 *
 * `seen_many(calls)`: the re-check's lstats after the journal (see seen_many below).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#define CREATE_FLAGS (O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC)

typedef struct {
    int dfd;
    const char *name;
    const char *data;
    Py_ssize_t len;
    mode_t mode;
    long long mtime_ns;
    int direct;
} write_job;

static int
as_int(PyObject *o, int *out)
{
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < INT_MIN || v > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "fd out of range");
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int
as_bytes(PyObject *o, const char **s, Py_ssize_t *len)
{
    if (!PyBytes_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "expected bytes");
        return -1;
    }
    *s = PyBytes_AS_STRING(o);
    if (len != NULL)
        *len = PyBytes_GET_SIZE(o);
    else if ((Py_ssize_t)strlen(*s) != PyBytes_GET_SIZE(o)) {
        PyErr_SetString(PyExc_ValueError, "embedded null byte in a name");
        return -1;
    }
    return 0;
}

/* One file, whole; 0, or the errno of the failing call (the file, if created, stays). */
static int
write_one(const write_job *j)
{
    int fd = openat(j->dfd, j->name, CREATE_FLAGS, j->direct ? j->mode : 0600);
    if (fd < 0)
        return errno;
    const char *p = j->data;
    Py_ssize_t left = j->len;
    int err = 0;
    while (left > 0) {
        ssize_t n = write(fd, p, (size_t)left);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            err = errno;
            break;
        }
        p += n;
        left -= n;
    }
    if (!err && !j->direct && fchmod(fd, j->mode) != 0)
        err = errno;
    if (!err) {
        struct timespec ts[2];
        ts[0].tv_sec = ts[1].tv_sec = (time_t)(j->mtime_ns / 1000000000LL);
        ts[0].tv_nsec = ts[1].tv_nsec = (long)(j->mtime_ns % 1000000000LL);
        if (ts[0].tv_nsec < 0) { /* before 1970: floor division, as Python's */
            ts[0].tv_sec -= 1;
            ts[1].tv_sec -= 1;
            ts[0].tv_nsec += 1000000000L;
            ts[1].tv_nsec += 1000000000L;
        }
        if (futimens(fd, ts) != 0)
            err = errno;
    }
    if (close(fd) != 0 && !err && errno != EINTR)
        err = errno;
    return err;
}

static PyObject *
write_files(PyObject *self, PyObject *arg)
{
    PyObject *calls = PySequence_Tuple(arg); /* holds every call (and its bytes) alive */
    if (calls == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(calls);
    write_job *jobs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(write_job));
    if (jobs == NULL) {
        Py_DECREF(calls);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyTuple_GET_ITEM(calls, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 6) {
            PyErr_SetString(PyExc_TypeError, "write_files: each call is a 6-tuple");
            goto fail;
        }
        write_job *j = &jobs[i];
        int mode;
        if (as_int(PyTuple_GET_ITEM(t, 0), &j->dfd) < 0
            || as_bytes(PyTuple_GET_ITEM(t, 1), &j->name, NULL) < 0
            || as_bytes(PyTuple_GET_ITEM(t, 2), &j->data, &j->len) < 0
            || as_int(PyTuple_GET_ITEM(t, 3), &mode) < 0)
            goto fail;
        j->mode = (mode_t)mode;
        j->mtime_ns = PyLong_AsLongLong(PyTuple_GET_ITEM(t, 4));
        if (j->mtime_ns == -1 && PyErr_Occurred())
            goto fail;
        j->direct = PyObject_IsTrue(PyTuple_GET_ITEM(t, 5));
        if (j->direct < 0)
            goto fail;
    }
    Py_ssize_t failed = -1;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        err = write_one(&jobs[i]);
        if (err) {
            failed = i;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(jobs);
    if (failed >= 0) {
        errno = err;
        PyErr_SetFromErrnoWithFilenameObject(
            PyExc_OSError, PyTuple_GET_ITEM(PyTuple_GET_ITEM(calls, failed), 1));
        Py_DECREF(calls);
        return NULL;
    }
    Py_DECREF(calls);
    Py_RETURN_NONE;
fail:
    PyMem_Free(jobs);
    Py_DECREF(calls);
    return NULL;
}

typedef struct {
    int trash_fd;
    const char *trash_name;
    int src_fd;
    const char *src_name;
    int dst_fd;
    const char *dst_name;
} rename_job;

static PyObject *
keep_and_rename(PyObject *self, PyObject *args)
{
    PyObject *arg;
    Py_ssize_t die_at;
    if (!PyArg_ParseTuple(args, "On:keep_and_rename", &arg, &die_at))
        return NULL;
    PyObject *calls = PySequence_Tuple(arg);
    if (calls == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(calls);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    rename_job *jobs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(rename_job));
    if (out == NULL || jobs == NULL) {
        Py_XDECREF(out);
        PyMem_Free(jobs);
        Py_DECREF(calls);
        return out == NULL ? NULL : PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyTuple_GET_ITEM(calls, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 6) {
            PyErr_SetString(PyExc_TypeError, "keep_and_rename: each call is a 6-tuple");
            goto fail;
        }
        rename_job *j = &jobs[i];
        if (as_int(PyTuple_GET_ITEM(t, 0), &j->trash_fd) < 0
            || as_bytes(PyTuple_GET_ITEM(t, 1), &j->trash_name, NULL) < 0
            || as_int(PyTuple_GET_ITEM(t, 2), &j->src_fd) < 0
            || as_bytes(PyTuple_GET_ITEM(t, 3), &j->src_name, NULL) < 0
            || as_int(PyTuple_GET_ITEM(t, 4), &j->dst_fd) < 0
            || as_bytes(PyTuple_GET_ITEM(t, 5), &j->dst_name, NULL) < 0)
            goto fail;
    }
    char *done = PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const rename_job *j = &jobs[i];
        if (linkat(j->dst_fd, j->dst_name, j->trash_fd, j->trash_name, 0) == 0
            || errno == EEXIST) {
            if (i == die_at)
                kill(getpid(), SIGKILL);
        }
        done[i] = renameat(j->src_fd, j->src_name, j->dst_fd, j->dst_name) == 0;
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(jobs);
    Py_DECREF(calls);
    return out;
fail:
    PyMem_Free(jobs);
    Py_DECREF(out);
    Py_DECREF(calls);
    return NULL;
}

/* `seen_many(calls)`: each call (dir_fd, name) lstat's `name` in `dir_fd` (fstatat with
 * AT_SYMLINK_NOFOLLOW) and gives shadowfs.commit._seen of it: None when nothing is there
 * (ENOENT, ENOTDIR, ELOOP, or a dir_fd of -1: its directory is not reachable), (dev, ino,
 * mode) for a directory, else (dev, ino, mode, size, mtime_ns, ctime_ns). Another error
 * raises OSError (errno, the name). The stats are taken with the lock released, all of them,
 * then made into tuples. */
static PyObject *
seen_many(PyObject *self, PyObject *arg)
{
    PyObject *calls = PySequence_Tuple(arg);
    if (calls == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(calls);
    PyObject *out = NULL;
    struct stat *sts = PyMem_Calloc(n ? (size_t)n : 1, sizeof(struct stat));
    int *errs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(int));
    int *fds = PyMem_Calloc(n ? (size_t)n : 1, sizeof(int));
    const char **names = PyMem_Calloc(n ? (size_t)n : 1, sizeof(char *));
    if (sts == NULL || errs == NULL || fds == NULL || names == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyTuple_GET_ITEM(calls, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2) {
            PyErr_SetString(PyExc_TypeError, "seen_many: each call is a 2-tuple");
            goto done;
        }
        if (as_int(PyTuple_GET_ITEM(t, 0), &fds[i]) < 0
            || as_bytes(PyTuple_GET_ITEM(t, 1), &names[i], NULL) < 0)
            goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (fds[i] < 0)
            errs[i] = ENOENT;
        else if (fstatat(fds[i], names[i], &sts[i], AT_SYMLINK_NOFOLLOW) != 0)
            errs[i] = errno;
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item;
        const struct stat *st = &sts[i];
        if (errs[i] == ENOENT || errs[i] == ENOTDIR || errs[i] == ELOOP) {
            item = Py_NewRef(Py_None);
        } else if (errs[i]) {
            errno = errs[i];
            PyErr_SetFromErrnoWithFilenameObject(
                PyExc_OSError, PyTuple_GET_ITEM(PyTuple_GET_ITEM(calls, i), 1));
            Py_CLEAR(out);
            goto done;
        } else if (S_ISDIR(st->st_mode)) {
            item = Py_BuildValue("(KKI)", (unsigned long long)st->st_dev,
                                 (unsigned long long)st->st_ino, (unsigned int)st->st_mode);
        } else {
            item = Py_BuildValue(
                "(KKILLL)", (unsigned long long)st->st_dev, (unsigned long long)st->st_ino,
                (unsigned int)st->st_mode, (long long)st->st_size,
                (long long)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec,
                (long long)st->st_ctim.tv_sec * 1000000000LL + st->st_ctim.tv_nsec);
        }
        if (item == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, item);
    }
done:
    PyMem_Free(sts);
    PyMem_Free(errs);
    PyMem_Free(fds);
    PyMem_Free(names);
    Py_DECREF(calls);
    return out;
}

static PyMethodDef methods[] = {
    {"write_files", write_files, METH_O,
     "write_files(calls): stage files whole, one (dir_fd, name, data, mode, mtime_ns, direct) "
     "each; raises OSError at the first failure."},
    {"keep_and_rename", keep_and_rename, METH_VARARGS,
     "keep_and_rename(calls, die_at): link each destination into the trash, then rename the "
     "staged file over it; bytes of 1 (done) or 0 (left to the caller)."},
    {"seen_many", seen_many, METH_O,
     "seen_many(calls): shadowfs.commit._seen of each (dir_fd, name), lstat'ed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shadowfs._batchio",
    "A big commit's per-file system calls, a batch per call (see _batchio.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__batchio(void)
{
    return PyModule_Create(&module);
}
