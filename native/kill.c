/* Process-tree kills: find every descendant of the supervisor through /proc and signal it, so that
 * nothing a command started outlives a kill request, however it forks meanwhile. */
#include "common.h"
#include "kill.h"

#define TABLE_CAP 65536          /* processes one /proc scan can hold */
#define MEMO_SLOTS (2 * TABLE_CAP) /* power of two */
#define CHAIN_MAX 4096           /* ppid hops when checking that a process is still ours */
#define WALK_ROUNDS 64           /* children-file walks per pass, while they find new processes */

struct proc_entry {
    int pid;
    int ppid;
    char state;
};

/* Everything a scan needs, allocated up front. */
static struct proc_entry table[TABLE_CAP];
static int queue[TABLE_CAP];
static struct {
    int pid;
    unsigned gen;
} memo[MEMO_SLOTS];
static unsigned memo_gen;
static char dents[32768] __attribute__((aligned(16)));
int tids[4096];
static int have_children_files; /* /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN) */
static int use_pidfd = 1;
int proc_fd = -1;
pid_t self_pid;
unsigned stat_tty;

int proc_init(void)
{
    self_pid = getpid();
    proc_fd = open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (proc_fd < 0)
        return errno;
    char children_path[64];
    snprintf(children_path, sizeof children_path, "%d/task/%d/children", (int)self_pid, (int)self_pid);
    have_children_files = faccessat(proc_fd, children_path, R_OK, 0) == 0;
    return 0;
}

static int no_fd_errno(int e)
{
    return e == EMFILE || e == ENFILE || e == ENOMEM;
}

/* Reads the state and ppid of PID from /proc/PID/stat with one new fd (closed before returning); its
 * controlling terminal goes to stat_tty (tty_nr, the kernel's encoding of a device number). */
int read_stat(int pid, int *ppid, char *state)
{
    char path[32], buf[256];
    snprintf(path, sizeof path, "%d/stat", pid);
    int fd = openat(proc_fd, path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0)
        return no_fd_errno(errno) ? STAT_NOFD : STAT_GONE;
    ssize_t n;
    do
        n = read(fd, buf, sizeof buf - 1);
    while (n < 0 && errno == EINTR);
    int e = errno;
    close(fd);
    if (n <= 0)
        return (n < 0 && no_fd_errno(e)) ? STAT_NOFD : STAT_GONE;
    buf[n] = '\0';
    /* "PID (COMM) S PPID ...": COMM may hold anything, so look for the last ')'. */
    char *p = memrchr(buf, ')', (size_t)n);
    if (!p || p[1] != ' ' || p[2] == '\0' || p[3] != ' ')
        return STAT_GONE;
    char *end;
    long v = strtol(p + 4, &end, 10);
    if (end == p + 4 || *end != ' ')
        return STAT_GONE;
    *state = p[2];
    *ppid = (int)v;
    /* Then pgrp, session and tty_nr: the controlling terminal (0: none). */
    stat_tty = 0;
    for (int k = 0; k < 3 && *end == ' '; k++) {
        char *field = end + 1;
        v = strtol(field, &end, 10);
        if (end == field)
            break;
        if (k == 2)
            stat_tty = (unsigned)v;
    }
    return STAT_OK;
}

static int by_ppid(const void *a, const void *b)
{
    const struct proc_entry *x = a, *y = b;
    return (x->ppid > y->ppid) - (x->ppid < y->ppid);
}

/* Fills table[] from /proc; returns the number of entries. *incomplete is set when a process could
 * not be read for want of a file descriptor or the table is full (the caller retries later). */
static int scan(int *incomplete, int *err)
{
    int count = 0;
    if (lseek(proc_fd, 0, SEEK_SET) < 0) {
        *incomplete = 1;
        *err = errno;
        return 0;
    }
    for (;;) {
        long n = syscall(SYS_getdents64, proc_fd, dents, sizeof dents);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            *incomplete = 1;
            *err = errno;
            break;
        }
        if (n == 0)
            break;
        for (long off = 0; off < n;) {
            /* struct linux_dirent64: ino (8), off (8), reclen (2), type (1), name */
            unsigned short reclen;
            memcpy(&reclen, dents + off + 16, sizeof reclen);
            const char *name = dents + off + 19;
            off += reclen;
            if (name[0] < '1' || name[0] > '9')
                continue;
            long pid = 0;
            const char *c = name;
            while (*c >= '0' && *c <= '9' && pid < 1L << 30)
                pid = pid * 10 + (*c++ - '0');
            if (*c != '\0')
                continue;
            if (count == TABLE_CAP) {
                *incomplete = 1;
                *err = ENOSPC;
                continue;
            }
            int ppid;
            char state;
            int r = read_stat((int)pid, &ppid, &state);
            if (r == STAT_NOFD) {
                *incomplete = 1;
                *err = errno;
                continue;
            }
            if (r != STAT_OK)
                continue; /* gone since the listing */
            table[count].pid = (int)pid;
            table[count].ppid = ppid;
            table[count].state = state;
            count++;
        }
    }
    return count;
}

static void memo_next_pass(void)
{
    if (++memo_gen == 0) {
        memset(memo, 0, sizeof memo);
        memo_gen = 1;
    }
}

static void memo_add(int pid)
{
    unsigned h = ((unsigned)pid * 2654435761u) & (MEMO_SLOTS - 1);
    for (unsigned i = 0; i < MEMO_SLOTS; i++, h = (h + 1) & (MEMO_SLOTS - 1)) {
        if (memo[h].gen != memo_gen || memo[h].pid == pid) {
            memo[h].pid = pid;
            memo[h].gen = memo_gen;
            return;
        }
    }
}

static int memo_has(int pid)
{
    unsigned h = ((unsigned)pid * 2654435761u) & (MEMO_SLOTS - 1);
    for (unsigned i = 0; i < MEMO_SLOTS; i++, h = (h + 1) & (MEMO_SLOTS - 1)) {
        if (memo[h].gen != memo_gen)
            return 0;
        if (memo[h].pid == pid)
            return 1;
    }
    return 0;
}

/* Is PID (read afresh) still a live descendant? Walks the ppid chain up to the supervisor, or to a
 * process already confirmed as a descendant in this pass. 1 yes, 0 no, STAT_NOFD retry later. */
static int still_ours(int pid)
{
    int cur = pid;
    for (int hops = 0; hops < CHAIN_MAX; hops++) {
        int ppid;
        char state;
        int r = read_stat(cur, &ppid, &state);
        if (r == STAT_NOFD)
            return STAT_NOFD;
        if (r != STAT_OK)
            return 0;
        if (cur == pid && (state == 'Z' || state == 'X'))
            return 0;
        if (ppid == self_pid)
            return 1;
        if (ppid <= 1)
            return 0;
        if (memo_has(ppid))
            return 1;
        cur = ppid;
    }
    return 0;
}

/* Signals PID if it is still ours: 1 signalled, 0 not (gone, not ours), STAT_NOFD retry later.
 * The pidfd pins the process first, so a pid recycled after the check is never signalled. */
static int signal_one(int pid, int sig)
{
    int pfd = -1;
    if (use_pidfd) {
        pfd = (int)syscall(SYS_pidfd_open, pid, 0);
        if (pfd < 0) {
            if (errno == ESRCH)
                return 0;
            if (no_fd_errno(errno))
                return STAT_NOFD;
            if (errno == ENOSYS || errno == EPERM) /* old kernel, or a seccomp filter */
                use_pidfd = 0;
            else
                return 0;
        }
    }
    int ours = still_ours(pid);
    int done = 0;
    if (ours == 1) {
        memo_add(pid);
        if (pfd >= 0)
            done = syscall(SYS_pidfd_send_signal, pfd, sig, NULL, 0) == 0;
        else
            done = kill(pid, sig) == 0;
        if (done && sig == SIGTERM) {
            /* A stopped process would only see SIGTERM once continued. */
            if (pfd >= 0)
                syscall(SYS_pidfd_send_signal, pfd, SIGCONT, NULL, 0);
            else
                kill(pid, SIGCONT);
        }
    }
    if (pfd >= 0)
        close(pfd);
    return ours == STAT_NOFD ? STAT_NOFD : done;
}

/* Signals CHILD (found in a children file) unless this pass handled it already; queues it when ours. */
static int consider(int child, int sig, int *tail, int *signalled, int *alive)
{
    if (child <= 0 || memo_has(child))
        return 0;
    int r = signal_one(child, sig);
    if (r == STAT_NOFD)
        return STAT_NOFD;
    if (memo_has(child)) { /* still ours: signal_one remembered it */
        *signalled += r;
        (*alive)++;
        if (*tail < TABLE_CAP)
            queue[(*tail)++] = child;
    }
    return 0;
}

/* Lists the threads of PID into tids[] (*ntids of them). Returns 0, or STAT_NOFD for want of a file
 * descriptor, or -1 when PID is gone. */
int read_tids(int pid, int *ntids)
{
    char path[32];
    snprintf(path, sizeof path, "%d/task", pid);
    int fd = openat(proc_fd, path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return no_fd_errno(errno) ? STAT_NOFD : -1;
    for (;;) {
        long n = syscall(SYS_getdents64, fd, dents, sizeof dents);
        if (n <= 0)
            break;
        for (long off = 0; off < n;) {
            unsigned short reclen;
            memcpy(&reclen, dents + off + 16, sizeof reclen);
            const char *name = dents + off + 19;
            off += reclen;
            long tid = strtol(name, NULL, 10);
            if (tid > 0 && *ntids < (int)(sizeof tids / sizeof tids[0]))
                tids[(*ntids)++] = (int)tid;
        }
    }
    close(fd);
    return 0;
}

/* Signals the children of PID listed in /proc/PID/task/TID/children as they are read, appending the
 * ones still ours to queue[] (from *tail). One fd at a time. Adds to *signalled and *alive; returns
 * STAT_NOFD when something could not be opened for want of a file descriptor, else 0. */
static int walk_children(int pid, int sig, int *tail, int *signalled, int *alive)
{
    char path[64];
    int ntids = 0, result = 0;
    int fd = read_tids(pid, &ntids);
    if (fd < 0)
        return fd == STAT_NOFD ? STAT_NOFD : 0;
    for (int t = 0; t < ntids; t++) {
        snprintf(path, sizeof path, "%d/task/%d/children", pid, tids[t]);
        fd = openat(proc_fd, path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            if (no_fd_errno(errno))
                result = STAT_NOFD;
            continue;
        }
        char buf[4096];
        long child = 0;
        ssize_t n;
        while ((n = read(fd, buf, sizeof buf)) > 0) {
            for (ssize_t k = 0; k < n; k++) {
                if (buf[k] >= '0' && buf[k] <= '9') {
                    child = child * 10 + (buf[k] - '0');
                    continue;
                }
                if (consider((int)child, sig, tail, signalled, alive) == STAT_NOFD)
                    result = STAT_NOFD;
                child = 0;
            }
        }
        if (consider((int)child, sig, tail, signalled, alive) == STAT_NOFD)
            result = STAT_NOFD;
        close(fd);
    }
    return result;
}

/* One signal pass over the whole subtree. First a walk down the /proc/PID/task/TID/children files
 * from the supervisor (cost: the subtree), signalling each process as it is found, so a chain of
 * short-lived forks cannot outrun it; then a scan of every /proc/PID/stat for the ppid map (cost:
 * the whole system), which finds whatever the children files missed. A process is signalled once
 * per pass. Returns how many were signalled; *alive is the number of live descendants found, plus
 * one if something could not be read (so a SIGKILL loop goes on). */
int kill_pass(int sig, int *alive)
{
    int incomplete = 0, err = 0, signalled = 0;
    *alive = 0;
    memo_next_pass();
    memo_add(self_pid);
    /* Walk again while a walk finds new processes: the child a process forked just before it was
     * killed re-parents to the supervisor, and the next walk, microseconds later, finds it. */
    for (int round = 0; have_children_files && round < WALK_ROUNDS; round++) {
        int head = 0, tail = 0, found = 0;
        queue[tail++] = self_pid;
        while (head < tail) {
            if (walk_children(queue[head++], sig, &tail, &signalled, &found) == STAT_NOFD) {
                incomplete = 1;
                err = EMFILE;
            }
        }
        *alive += found;
        if (found == 0)
            break;
    }
    int n = scan(&incomplete, &err);
    if (incomplete && no_fd_errno(err)) {
        /* Someone may have lowered our RLIMIT_NOFILE (prlimit works across same-user processes). */
        struct rlimit rl;
        if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
            rl.rlim_cur = rl.rlim_max;
            setrlimit(RLIMIT_NOFILE, &rl);
        }
    }
    qsort(table, (size_t)n, sizeof table[0], by_ppid);
    int head = 0, tail = 0;
    queue[tail++] = self_pid;
    while (head < tail) {
        int parent = queue[head++];
        int lo = 0, hi = n;
        while (lo < hi) { /* first entry with ppid >= parent */
            int mid = lo + (hi - lo) / 2;
            if (table[mid].ppid < parent)
                lo = mid + 1;
            else
                hi = mid;
        }
        for (int i = lo; i < n && table[i].ppid == parent && tail < TABLE_CAP; i++) {
            if (table[i].state != 'Z' && table[i].state != 'X' && table[i].pid != self_pid)
                queue[tail++] = table[i].pid;
        }
    }
    for (int i = 1; i < tail; i++) { /* breadth first: parents before their children */
        if (memo_has(queue[i]))
            continue; /* signalled (or found ours) by the walk already */
        int r = signal_one(queue[i], sig);
        if (r == STAT_NOFD) {
            incomplete = 1;
            err = EMFILE;
        } else if (memo_has(queue[i])) {
            signalled += r;
            (*alive)++;
        }
    }
    if (incomplete)
        record("warning proc-scan %d", err);
    if (incomplete)
        (*alive)++;
    return signalled;
}
