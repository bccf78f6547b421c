/* Is the command waiting for input? A look down the supervisor's subtree for a process blocked
 * reading the command's input (frame mode's `input waiting` / `input busy`, see framed.c). */
#include "common.h"
#include "kill.h"
#include "waiting.h"

#define SAMPLE_MAX 256 /* processes looked at in one: a bound on the cost of a look */

/* The command's input as stat(2) shows it, taken once at spawn (a pipe: st_dev and st_ino of our
 * write end; a terminal: st_rdev of its slave). */
static int input_is_terminal;
static dev_t input_dev;
static ino_t input_ino;

void input_identity(int is_terminal, dev_t dev, ino_t ino)
{
    input_is_terminal = is_terminal;
    input_dev = dev;
    input_ino = ino;
}

/* The system calls a reader of the input blocks in: read(2)'s kin with the fd as arg0, and select(2)'s
 * kin, which is taken as a read of fd 0 only with nfds 1 and neither write nor except sets. */
#if defined(__x86_64__)
static const long read_calls[] = {0, 19, 17}; /* read, readv, pread64 */
static const long select_calls[] = {23, 270}; /* select, pselect6 */
#elif defined(__aarch64__)
static const long read_calls[] = {63, 65, 67};
static const long select_calls[] = {72};
#else
static const long read_calls[] = {-2};
static const long select_calls[] = {-2};
#endif

static int in_calls(long nr, const long *calls, size_t n)
{
    for (size_t k = 0; k < n; k++)
        if (calls[k] == nr)
            return 1;
    return 0;
}

/* The fd PID is blocked reading at this moment (state S, in one of the calls above), else -1. */
static int blocked_read_fd(int pid)
{
    int ppid;
    char state;
    if (read_stat(pid, &ppid, &state) != STAT_OK || state != 'S')
        return -1;
    char path[32], buf[256];
    snprintf(path, sizeof path, "%d/syscall", pid);
    int fd = openat(proc_fd, path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
    if (fd < 0)
        return -1; /* gone, or not ours to look at: never reported */
    ssize_t n;
    do
        n = read(fd, buf, sizeof buf - 1);
    while (n < 0 && errno == EINTR);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    /* "NR ARG0 ... ARG5 SP PC" (NR decimal, the rest hex), or "running", or "-1 SP PC". */
    if (buf[0] < '0' || buf[0] > '9')
        return -1;
    char *p = buf, *end;
    long nr = strtol(p, &end, 10);
    unsigned long long args[4];
    p = end;
    for (int k = 0; k < 4; k++) {
        if (*p != ' ')
            return -1;
        args[k] = strtoull(p + 1, &end, 16);
        if (end == p + 1)
            return -1;
        p = end;
    }
    if (in_calls(nr, read_calls, sizeof read_calls / sizeof read_calls[0]))
        return args[0] <= 0x7fffffff ? (int)args[0] : -1;
    if (in_calls(nr, select_calls, sizeof select_calls / sizeof select_calls[0]) && args[0] == 1 &&
        args[2] == 0 && args[3] == 0)
        return 0;
    return -1;
}

/* Whether /proc/PID/fd/FD is the command's input: the pipe, or the terminal (any fd opened on it,
 * /dev/tty too, has its device number). */
static int is_input(int pid, int fd)
{
    char path[48];
    struct stat st;
    snprintf(path, sizeof path, "%d/fd/%d", pid, fd);
    if (fstatat(proc_fd, path, &st, 0) < 0)
        return 0;
    /* An fd opened on /dev/tty is that device's (5, 0), whatever terminal it reaches: the caller's
     * controlling one, which read_stat just gave for this process. tty_nr is encoded as
     * new_encode_dev(): minor's low byte, the major from bit 8, the minor's rest from bit 20. */
    unsigned major_ = major(input_dev), minor_ = minor(input_dev);
    unsigned input_tty = (minor_ & 0xff) | (major_ << 8) | ((minor_ & ~0xffu) << 12);
    if (input_is_terminal)
        return st.st_rdev != 0 &&
               (st.st_rdev == input_dev || (st.st_rdev == makedev(5, 0) && stat_tty == input_tty));
    return st.st_dev == input_dev && st.st_ino == input_ino;
}

/* One look down the subtree from the supervisor (the children files, as a kill pass walks them, but
 * nothing is signalled): 1 when some process is blocked reading the input. A process that forks or
 * ends meanwhile may be missed; the harness asks for two looks in a row. */
int input_waiter(void)
{
    int queue[SAMPLE_MAX];
    int head = 0, tail = 0;
    queue[tail++] = self_pid;
    while (head < tail) {
        int pid = queue[head++];
        if (pid != self_pid) {
            int fd = blocked_read_fd(pid);
            if (fd >= 0 && is_input(pid, fd))
                return 1;
        }
        int ntids = 0;
        if (tail >= SAMPLE_MAX || read_tids(pid, &ntids) < 0)
            continue;
        for (int t = 0; t < ntids && tail < SAMPLE_MAX; t++) {
            char path[64], buf[4096];
            snprintf(path, sizeof path, "%d/task/%d/children", pid, tids[t]);
            int fd = openat(proc_fd, path, O_RDONLY | O_CLOEXEC);
            if (fd < 0)
                continue;
            long child = 0;
            ssize_t n;
            while (tail < SAMPLE_MAX && (n = read(fd, buf, sizeof buf)) > 0) {
                for (ssize_t k = 0; k < n && tail < SAMPLE_MAX; k++) {
                    if (buf[k] >= '0' && buf[k] <= '9') {
                        child = child * 10 + (buf[k] - '0');
                        continue;
                    }
                    if (child > 0)
                        queue[tail++] = (int)child;
                    child = 0;
                }
            }
            if (child > 0 && tail < SAMPLE_MAX)
                queue[tail++] = (int)child;
            close(fd);
        }
    }
    return 0;
}
