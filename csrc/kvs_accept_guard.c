/*
 * kvs_accept_guard.c: accept() and accept4() that never fail with EMFILE or
 * ENFILE. Preloaded into the sidecar (LD_PRELOAD; kvstrata.sidecar.acceptguard).
 *
 * Why: libzmq 4.3.5 treats an accept that fails with EMFILE on an ipc://
 * listener as a bug (errno_assert in ipc_listener_t::accept): the process
 * aborts. Its tcp:// listener and a level-triggered poller spin instead, on a
 * connection that stays queued. The failure must not reach any listener.
 *
 * How: one spare descriptor (/dev/null) is held from load time. When the
 * real accept fails for want of a descriptor, the spare is closed, which
 * frees one number; the pending connection is accepted on it and closed at
 * once (its peer sees the connection end and may retry later, as ZeroMQ
 * reconnects); the spare is opened again; the caller gets -1 with errno
 * EAGAIN, which every non-blocking listener reads as "nothing to accept".
 * The queue drains one connection per failed accept, so a flood cannot keep
 * a listener readable for ever.
 *
 * Threads: libzmq's I/O threads and Python's threads accept concurrently; one
 * mutex makes the close-spare / accept / reopen sequence atomic among them.
 * A descriptor opened by another thread between the spare's close and the
 * accept (it takes the freed number) makes that accept fail too: the caller
 * still gets EAGAIN, and the spare is reopened when a number is free again.
 *
 * Blocking listeners: the drain accepts only after poll() says a connection
 * is pending, so it cannot wait while holding the mutex on a listener whose
 * queue another thread emptied.
 *
 * What it dropped is counted per listening descriptor (a small table; the
 * rest under one slot) and read through kvs_accept_guard_* below.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <unistd.h>

#define KVS_EXPORT __attribute__((visibility("default")))
#define LISTENER_SLOTS 32

typedef int (*accept_fn)(int, struct sockaddr *, socklen_t *);
typedef int (*accept4_fn)(int, struct sockaddr *, socklen_t *, int);

static accept_fn real_accept;
static accept4_fn real_accept4;
static pthread_mutex_t guard_lock = PTHREAD_MUTEX_INITIALIZER;
static int spare_fd = -1;

/* Connections dropped, per listening descriptor: written under guard_lock,
 * read without it (atomics). Slot fd -1 is free; the last slot takes every
 * listener the table has no room for. */
static atomic_int slot_fd[LISTENER_SLOTS];
static atomic_ulong slot_dropped[LISTENER_SLOTS];
static atomic_ulong dropped_total;
static atomic_ulong spare_missing; /* failed accepts met with no spare to give up */

static int open_spare(void) { return open("/dev/null", O_RDONLY | O_CLOEXEC); }

__attribute__((constructor)) static void kvs_accept_guard_init(void) {
    real_accept = (accept_fn)dlsym(RTLD_NEXT, "accept");
    real_accept4 = (accept4_fn)dlsym(RTLD_NEXT, "accept4");
    for (int i = 0; i < LISTENER_SLOTS; i++) slot_fd[i] = -1;
    spare_fd = open_spare();
}

static int out_of_descriptors(int err) { return err == EMFILE || err == ENFILE; }

/* Called with guard_lock held. */
static void count_dropped(int listener) {
    int slot = LISTENER_SLOTS - 1;
    for (int i = 0; i < LISTENER_SLOTS - 1; i++) {
        if (slot_fd[i] == listener) {
            slot = i;
            break;
        }
        if (slot_fd[i] == -1) {
            slot_fd[i] = listener;
            slot = i;
            break;
        }
    }
    atomic_fetch_add(&slot_dropped[slot], 1);
    atomic_fetch_add(&dropped_total, 1);
}

/* The real accept failed for want of a descriptor: drop one pending
 * connection on the spare's number and answer EAGAIN. */
static int shed_one(int listener) {
    pthread_mutex_lock(&guard_lock);
    if (spare_fd >= 0) {
        close(spare_fd);
        spare_fd = -1;
    } else {
        atomic_fetch_add(&spare_missing, 1);
    }
    struct pollfd pending = {.fd = listener, .events = POLLIN, .revents = 0};
    if (poll(&pending, 1, 0) == 1 && (pending.revents & POLLIN)) {
        int conn = real_accept4(listener, NULL, NULL, SOCK_CLOEXEC);
        if (conn >= 0) {
            close(conn);
            count_dropped(listener);
        }
    }
    spare_fd = open_spare();
    pthread_mutex_unlock(&guard_lock);
    errno = EAGAIN;
    return -1;
}

KVS_EXPORT int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
    if (real_accept4 == NULL) real_accept4 = (accept4_fn)dlsym(RTLD_NEXT, "accept4");
    int conn = real_accept4(fd, addr, len, flags);
    if (conn < 0 && out_of_descriptors(errno)) return shed_one(fd);
    return conn;
}

KVS_EXPORT int accept(int fd, struct sockaddr *addr, socklen_t *len) {
    if (real_accept == NULL) real_accept = (accept_fn)dlsym(RTLD_NEXT, "accept");
    int conn = real_accept(fd, addr, len);
    if (conn < 0 && out_of_descriptors(errno)) {
        if (real_accept4 == NULL) real_accept4 = (accept4_fn)dlsym(RTLD_NEXT, "accept4");
        return shed_one(fd);
    }
    return conn;
}

/* Connections dropped since load: all (listener < 0) or one listener's. */
KVS_EXPORT unsigned long kvs_accept_guard_dropped(int listener) {
    if (listener < 0) return atomic_load(&dropped_total);
    for (int i = 0; i < LISTENER_SLOTS - 1; i++)
        if (slot_fd[i] == listener) return atomic_load(&slot_dropped[i]);
    return 0;
}

/* The spare descriptor (-1 while none could be reopened). */
KVS_EXPORT int kvs_accept_guard_spare(void) {
    pthread_mutex_lock(&guard_lock);
    int fd = spare_fd;
    pthread_mutex_unlock(&guard_lock);
    return fd;
}

/* Failed accepts that found no spare to give up (a descriptor opened
 * elsewhere took the freed number before the spare was reopened). */
KVS_EXPORT unsigned long kvs_accept_guard_spare_missing(void) {
    return atomic_load(&spare_missing);
}
