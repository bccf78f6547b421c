/*
 * The supervisor every mode shares: it makes itself a subreaper, spawns PROGRAM, reaps whatever ends
 * up as its child, serves kill requests, and exits once no child is left. The modes differ in their
 * channel to the harness (struct mode), not in this; the plain mode (--status-fd, --control-fd) is
 * here too.
 *
 * Status records (only with --status-fd):
 *   started PID         PROGRAM was exec'd (PID leads its own session and process group)
 *   execfail ERRNO      exec failed (an `exit 127` record follows for the child that reported it)
 *   ptyfail ERRNO       --frame with a terminal (version 5): the pseudo-terminal could not be made (no
 *                       devpts where the supervisor runs, say); nothing was started, `exit 127` follows
 *   exit CODE           the PROGRAM process exited (descendants may live on)
 *   signal NUM[ core]   the PROGRAM process was killed by a signal
 *   signalled N         answer to a kill request: N processes signalled by its first pass
 *   supervisor PID T    --detach only, always the first: the detached supervisor's pid and start time
 *   warning TEXT        something degraded (e.g. `warning proc-scan ERRNO`); consumers may ignore it
 *   input ...           --frame only (version 5): see framed.c
 *   empty               no child is left at all; the supervisor exits 0 right after
 *
 * Kill requests: SIGUSR1 or byte 'T' on the control fd sends SIGTERM (then SIGCONT) to every live
 * descendant; SIGUSR2 or byte 'K' sends SIGKILL to every descendant and repeats scan+kill passes
 * until a scan finds none alive. With --grace-ms N (version 6), the first SIGTERM request is followed,
 * N ms later, by the SIGKILL of a 'K' request, unless one came first. EOF on the control fd (or SIGUSR2 from --die-with-parent) means the
 * harness is gone: kill everything and exit once empty.
 *
 * PROGRAM is started by posix_spawnp (a clone sharing memory until the exec): default dispositions,
 * empty mask, a session of its own; PATH is searched in the command's environment. In the status-fd
 * modes, records of one moment are written together, before the supervisor blocks or exits.
 */
#include "common.h"
#include "kill.h"
#include "supervisor.h"

#define PASS_MIN_MS 2 /* pause between SIGKILL passes, doubling up to PASS_MAX_MS */
#define PASS_MAX_MS 50

int sig_fd = -1;
pid_t child_pid = -1;
int want_term, want_kill;
/* What becomes of this process as a supervisor, done ahead of its command (a spare does it while it
 * waits, off the path of the request it will take): a subreaper; /proc, to find descendants; /dev/null,
 * opened before the spawn so that dropping the command's stdio needs no new fd. A failure is kept, to
 * be reported once a status channel exists. */
static int dev_null = -1;
static int subreaper_errno, proc_errno, dev_null_errno;

/* The command (PROGRAM and its arguments, a whole `bash -c COMMAND`) was copied out of the argument
 * area, which is cleared: /proc/<pid>/cmdline of a supervisor that outlives the command's shell must
 * not read like one of the command's processes to whoever looks for them by their command line (nor
 * show the command's text to `ps` for longer than the command runs). */
void clear_arguments(const struct options *o)
{
    char *area_end = o->argv[o->argc - 1] + strlen(o->argv[o->argc - 1]);
    if (o->argc > 1)
        memset(o->argv[1], 0, (size_t)(area_end - o->argv[1]));
}

/* Signals: a few ignored, the ones it acts on blocked and read through a signalfd. SIGCHLD must not
 * stay ignored if the parent left it so, or the kernel would reap children for us. FILES_WRITTEN
 * (--detach): a lowered RLIMIT_FSIZE fails a record's write, it does not kill the supervisor. */
void take_signals(int files_written)
{
    static const int ignored[] = {SIGINT, SIGQUIT, SIGHUP, SIGPIPE, SIGTERM, SIGTSTP, SIGTTIN, SIGTTOU};
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_IGN;
    for (size_t k = 0; k < sizeof ignored / sizeof ignored[0]; k++)
        sigaction(ignored[k], &sa, NULL);
    if (files_written)
        sigaction(SIGXFSZ, &sa, NULL);
    sa.sa_handler = SIG_DFL;
    sigaction(SIGCHLD, &sa, NULL);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGUSR1);
    sigaddset(&mask, SIGUSR2);
    if (sigprocmask(SIG_BLOCK, &mask, NULL) < 0)
        die("sigprocmask: %s", strerror(errno));
    sig_fd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sig_fd < 0)
        die("signalfd: %s", strerror(errno));
}

/* --die-with-parent: SIGUSR2 (a kill of everything) once the parent is gone, which it must not be yet. */
void parent_death_signal(void)
{
    pid_t parent = getppid();
    if (prctl(PR_SET_PDEATHSIG, SIGUSR2, 0, 0, 0) < 0)
        die("prctl(PR_SET_PDEATHSIG): %s", strerror(errno));
    if (getppid() != parent)
        die("the parent is already gone");
}

/* Field 22 of /proc/self/stat, the start time in clock ticks since boot: with the pid, it names this
 * process for good (the harness checks both before it signals a pid that may have been reused). */
unsigned long long own_start_time(void)
{
    char buf[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        die("cannot open /proc/self/stat: %s", strerror(errno));
    ssize_t n;
    do
        n = read(fd, buf, sizeof buf - 1);
    while (n < 0 && errno == EINTR);
    close(fd);
    if (n <= 0)
        die("cannot read /proc/self/stat");
    buf[n] = '\0';
    /* The comm may hold spaces and parentheses: count fields from the last ')'. Field 3 follows its
     * first space, so field 22 follows the 20th. */
    char *p = memrchr(buf, ')', (size_t)n);
    for (int spaces = 0; p != NULL && spaces < 20; spaces++) {
        p = strchr(p, ' ');
        if (p != NULL)
            p++;
    }
    char *end;
    unsigned long long ticks = p != NULL ? strtoull(p, &end, 10) : 0;
    if (p == NULL || end == p)
        die("cannot read the start time in /proc/self/stat");
    return ticks;
}

void prepare_supervisor(void)
{
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0)
        subreaper_errno = errno;
    /* Refused without CAP_SYS_ADMIN (EACCES), where the kernel already refuses TIOCSTI to a command
     * (seccomp.c): nothing to report either way. */
    (void)refuse_terminal_injection();
    proc_errno = proc_init();
    dev_null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (dev_null < 0)
        dev_null_errno = errno;
}

/* What prepare_supervisor could not do, said now that records reach the harness. */
void check_supervisor(int allow_no_subreaper)
{
    if (subreaper_errno != 0) {
        if (!allow_no_subreaper)
            die("prctl(PR_SET_CHILD_SUBREAPER): %s", strerror(subreaper_errno));
        record("warning no-subreaper %d", subreaper_errno);
    }
    if (proc_fd < 0)
        die("cannot open /proc: %s", strerror(proc_errno));
    if (dev_null < 0)
        die("cannot open /dev/null: %s", strerror(dev_null_errno));
}

/* A copy of BASE without the variables named in NAMES, then NAME=VALUE for each (a later one wins). */
char **command_environment(char **base, const struct options *o)
{
    char **names = o->setenv_names, **values = o->setenv_values;
    int count = o->setenv_count;
    size_t n = 0;
    while (base[n] != NULL)
        n++;
    if (count == 0)
        return base;
    char **env = calloc(n + (size_t)count + 1, sizeof *env);
    if (env == NULL)
        die("out of memory");
    size_t used = 0;
    for (size_t k = 0; k < n; k++) {
        int replaced = 0;
        for (int j = 0; j < count && !replaced; j++) {
            size_t len = strlen(names[j]);
            replaced = strncmp(base[k], names[j], len) == 0 && base[k][len] == '=';
        }
        if (!replaced)
            env[used++] = base[k];
    }
    for (int j = 0; j < count; j++) {
        int later = 0;
        for (int l = j + 1; l < count && !later; l++)
            later = strcmp(names[j], names[l]) == 0;
        if (later)
            continue;
        size_t size = strlen(names[j]) + strlen(values[j]) + 2;
        char *entry = malloc(size);
        if (entry == NULL)
            die("out of memory");
        snprintf(entry, size, "%s=%s", names[j], values[j]);
        env[used++] = entry;
    }
    return env;
}

/* posix_spawn: a clone that shares this process's memory until the exec (no page tables copied,
 * which a fork of even this small process costs on every command). Every fd of ours is close-on-exec;
 * the child gets default dispositions for what we ignore, an empty mask, and a session of its own.
 * Returns 0 with child_pid set, or the errno of the failed spawn (posix_spawn reaped that child). */
int spawn_command(const struct launch *l)
{
    posix_spawn_file_actions_t actions;
    posix_spawnattr_t attr;
    sigset_t all, none;
    sigfillset(&all);
    sigemptyset(&none);
    if (posix_spawn_file_actions_init(&actions) != 0 || posix_spawnattr_init(&attr) != 0 ||
        posix_spawnattr_setsigdefault(&attr, &all) != 0 || posix_spawnattr_setsigmask(&attr, &none) != 0 ||
        posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK) != 0)
        die("posix_spawn attributes: out of memory");
    for (int k = 0; k < 3 && l->slave == NULL; k++)
        if (l->stdio[k] >= 0 && posix_spawn_file_actions_adddup2(&actions, l->stdio[k], k) != 0)
            die("posix_spawn file actions: out of memory");
    /* A command whose stdin is a terminal gets it as its controlling terminal (Ctrl-C, job control,
     * /dev/tty), as a login shell does. Opening it anew does that: the child leads a new session by
     * now (setsid runs before the file actions in glibc and musl), and a session leader without one
     * acquires the first terminal it opens without O_NOCTTY. A terminal that is already another
     * session's is not taken (the open just succeeds). By its name: glibc's addopen closes the target
     * fd before it opens the path, so "/proc/self/fd/0" would name nothing by then (musl opens first,
     * which hid this from the static builds). Without a name (no /dev/pts here) it stays fd 0 as is. */
    char terminal[256];
    if (l->own_terminal && isatty(0) && ttyname_r(0, terminal, sizeof terminal) == 0 &&
        posix_spawn_file_actions_addopen(&actions, 0, terminal, O_RDWR, 0) != 0)
        die("posix_spawn file actions: out of memory");
    /* The terminal of frame mode: opened the same way, it becomes the session's controlling terminal
     * and the child's process group its foreground group. Only the child ever opens the slave: once
     * every process closed it, the master reads EIO, the terminal's EOF. */
    if (l->slave != NULL && (posix_spawn_file_actions_addopen(&actions, 0, l->slave, O_RDWR, 0) != 0 ||
                             posix_spawn_file_actions_adddup2(&actions, 0, 1) != 0 ||
                             posix_spawn_file_actions_adddup2(&actions, 0, 2) != 0))
        die("posix_spawn file actions: out of memory");
    if (l->status_to >= 0 && posix_spawn_file_actions_adddup2(&actions, status_fd, l->status_to) != 0)
        die("posix_spawn file actions: out of memory");
    if (l->capture >= 0 && posix_spawn_file_actions_adddup2(&actions, l->capture, l->capture_to) != 0)
        die("posix_spawn file actions: out of memory");
    /* Our pid and pidfd (and whatever else is recorded) go out before the command runs: the program
     * may write records of its own there, and its first act may be to stop this process (SIGSTOP,
     * same user), which must not keep the harness from the handle it continues us by. */
    flush_status();
    char **own_env = environ;
    environ = l->env; /* what posix_spawnp searches PATH with, as Popen(env=) does */
    int err = posix_spawnp(&child_pid, l->program[0], &actions, &attr, l->program, l->env);
    environ = own_env;
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    if (err != 0)
        child_pid = -1;
    return err;
}

/* The command's stdin, stdout and stderr are its own: held here, its output would never reach EOF
 * while the supervisor waits for leftovers. From FIRST_FD on, ours point at /dev/null; the status
 * channel is the only one left. */
void settle_stdio(int first_fd, int control_fd)
{
    for (int fd = first_fd; fd <= 2; fd++)
        if (fd != status_fd && fd != control_fd)
            dup2(dev_null, fd);
    close(dev_null);
}

/* --detach: the harness's channel (fds 0-2) closes once the parent exits: the supervisor holds none
 * of it. */
void stdio_to_null(void)
{
    for (int fd = 0; fd <= 2; fd++)
        if (dup2(dev_null, fd) < 0)
            die("dup2: %s", strerror(errno));
}

/* The first records: what became of the start. 1 when PROGRAM runs. */
int report_start(int pty_err, int exec_err)
{
    if (pty_err != 0) {
        record("ptyfail %d", pty_err); /* no devpts where the supervisor runs, say */
        record("exit 127");
        return 0;
    }
    if (exec_err != 0) {
        record("execfail %d", exec_err);
        record("exit 127"); /* as a child that failed its exec and exited 127 (posix_spawn reaped it) */
        return 0;
    }
    record("started %d", (int)child_pid);
    return 1;
}

/* Reaps every child that has ended; reports the PROGRAM process. Returns 1 when none is left. */
static int reap(const struct mode *m)
{
    for (;;) {
        int st;
        pid_t p = waitpid(-1, &st, WNOHANG | __WALL);
        if (p > 0) {
            if (p == child_pid) {
                if (m->program_ended != NULL)
                    m->program_ended();
                if (WIFEXITED(st))
                    record("exit %d", WEXITSTATUS(st));
                else if (WIFSIGNALED(st))
                    record("signal %d%s", WTERMSIG(st), WCOREDUMP(st) ? " core" : "");
                child_pid = -1;
            }
            continue;
        }
        if (p == 0)
            return 0;
        if (errno == EINTR)
            continue;
        return errno == ECHILD;
    }
}

struct killing {
    int active; /* SIGKILL passes go on until one finds nothing alive */
    int pause_ms;
    long long next_pass;
    long long escalate_at; /* --grace-ms: when the SIGKILL a SIGTERM request calls for is due; -1: none */
};

/* Serves the kill requests that came, and the next SIGKILL pass when the clock says it is due (however
 * busy SIGCHLD keeps the loop). With --grace-ms, a SIGTERM request is a whole kill sequence: its SIGKILL
 * follows by this process's own clock, so a harness whose requests travel slowly (a new SSH session
 * each, on a loaded host) cannot stretch the grace; the harness's own SIGKILL, when it comes, finds
 * the work done. 1: go round again at once, to reap what died before waiting. */
static int serve_kills(struct killing *k, const struct mode *m)
{
    int alive;
    if (want_term) {
        want_term = 0;
        record("signalled %d", kill_pass(SIGTERM, &alive));
        if (m->grace_ms >= 0 && k->escalate_at < 0)
            k->escalate_at = now_ms() + m->grace_ms;
    }
    if (k->escalate_at >= 0 && now_ms() >= k->escalate_at && !want_kill) {
        want_kill = 1; /* the grace is over: as if SIGKILL had been asked for */
        if (m->kill_asked != NULL)
            m->kill_asked();
    }
    if (want_kill) {
        want_kill = 0;
        k->escalate_at = -1;
        record("signalled %d", kill_pass(SIGKILL, &alive));
        k->active = alive > 0;
        k->pause_ms = PASS_MIN_MS;
        k->next_pass = now_ms() + k->pause_ms;
        return 1;
    }
    if (k->active && now_ms() >= k->next_pass) {
        kill_pass(SIGKILL, &alive);
        k->active = alive > 0;
        if (k->pause_ms < PASS_MAX_MS)
            k->pause_ms = k->pause_ms * 2 > PASS_MAX_MS ? PASS_MAX_MS : k->pause_ms * 2;
        k->next_pass = now_ms() + k->pause_ms;
        return 1;
    }
    return 0;
}

/* SIGUSR1 asks for SIGTERM, SIGUSR2 for SIGKILL; SIGCHLD only wakes the loop. */
static void read_signals(const struct mode *m)
{
    struct signalfd_siginfo si[16];
    ssize_t n;
    while ((n = read(sig_fd, si, sizeof si)) > 0) {
        for (size_t k = 0; k < (size_t)n / sizeof si[0]; k++) {
            if (si[k].ssi_signo == SIGUSR1)
                want_term = 1;
            else if (si[k].ssi_signo == SIGUSR2)
                want_kill = 1;
        }
    }
    if (want_kill && m->kill_asked != NULL)
        m->kill_asked();
}

/* 'T' and 'K' on the control fd; its EOF means the harness is gone, and nobody is left to ask for a
 * kill: kill everything. */
static void read_control(int *control_fd)
{
    char buf[64];
    ssize_t n = read(*control_fd, buf, sizeof buf);
    if (n > 0) {
        for (ssize_t k = 0; k < n; k++) {
            if (buf[k] == 'T')
                want_term = 1;
            else if (buf[k] == 'K')
                want_kill = 1;
        }
    } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        *control_fd = -1;
        want_kill = 1;
    }
}

/* Runs until no child is left (and the mode has nothing more to say); returns the exit status. */
int supervise(const struct mode *m)
{
    struct pollfd pfds[8];
    struct killing k = {0, PASS_MIN_MS, 0, -1};
    int control_fd = m->control_fd, no_children = 0;
    for (;;) {
        if (!no_children && reap(m)) {
            no_children = 1;
            if (m->children_gone != NULL)
                m->children_gone();
        }
        if (no_children) {
            int end = END_EXIT;
            if (m->ending != NULL)
                end = m->ending();
            else
                record("empty");
            if (end == END_EXIT) {
                flush_status();
                return 0;
            }
            if (end == END_AGAIN)
                continue;
            want_term = want_kill = k.active = 0; /* `empty` is due: no request is served any more */
            k.escalate_at = -1;
        }
        if (serve_kills(&k, m))
            continue;
        int nfds = 0, at_control = -1, timeout = -1;
        pfds[nfds].fd = sig_fd;
        pfds[nfds++].events = POLLIN;
        if (control_fd >= 0) {
            at_control = nfds;
            pfds[nfds].fd = control_fd;
            pfds[nfds++].events = POLLIN;
        }
        if (k.active || k.escalate_at >= 0) {
            long long due = k.active ? k.next_pass : k.escalate_at;
            if (k.active && k.escalate_at >= 0 && k.escalate_at < due)
                due = k.escalate_at;
            long long left = due - now_ms();
            timeout = left < 0 ? 0 : (int)left;
        }
        if (m->add_polls != NULL && (nfds = m->add_polls(pfds, nfds, no_children, &timeout)) < 0)
            continue;
        flush_status();
        int r = poll(pfds, (nfds_t)nfds, timeout);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            die("poll: %s", strerror(errno));
        }
        if (r == 0)
            continue; /* a pass is due, or the mode has something to do by the clock */
        if (pfds[0].revents & POLLIN)
            read_signals(m);
        if (at_control >= 0 && pfds[at_control].revents)
            read_control(&control_fd);
        if (m->serve_polls != NULL)
            m->serve_polls(pfds);
    }
}

/* The status-fd mode: records on --status-fd, requests on --control-fd and as signals; the command
 * inherits the supervisor's stdio. */
int run_plain(struct options *o)
{
    status_fd = o->status_fd;
    clear_arguments(o);
    take_signals(0);
    prepare_supervisor();
    if (o->die_with_parent)
        parent_death_signal();
    check_supervisor(o->allow_no_subreaper);
    struct launch l = {o->program, command_environment(environ, o), {-1, -1, -1}, NULL, 1, -1, -1, -1};
    int err = spawn_command(&l);
    settle_stdio(0, o->control_fd);
    report_start(0, err);
    struct mode m = {.control_fd = o->control_fd, .grace_ms = o->grace_ms};
    return supervise(&m);
}
