/* The supervisor every mode shares: the command line as parsed, the spawn of PROGRAM, and the loop
 * that reaps, serves kill requests and waits; each mode plugs its own channel in through struct mode. */
#ifndef DSH_SUPERVISOR_H
#define DSH_SUPERVISOR_H

#include <poll.h>
#include <sys/types.h>

/* The command line, checked by main for what goes with what. */
struct options {
    int status_fd, control_fd; /* plain mode; -1 when not given */
    int die_with_parent, allow_no_subreaper;
    int spec;                                 /* --frame --spec */
    char *warm_bash;                          /* --warm BASH; NULL: not that mode */
    int self_fd;                              /* --self-fd N given: exec'd from a sealed copy (warm.c) */
    int stdin_null;                           /* --frame --stdin-null */
    unsigned short tty_rows, tty_cols;        /* --frame --tty; 0: no terminal */
    char *status_path, *stdio_paths[3];       /* --detach */
    long long cap_bytes;                      /* --detach --cap-bytes; -1: none */
    long long grace_ms;                       /* --grace-ms; -1: SIGKILL only when asked */
    int capture_fd;                           /* --frame --capture-fd N (or --spec's); -1: none */
    char *cap_path;
    char **program;                           /* copied out of the argument area */
    char **setenv_names, **setenv_values;
    int setenv_count;
    int argc;
    char **argv;
};

/* What a mode adds to the loop; a NULL hook does nothing. */
enum { END_EXIT, END_AGAIN, END_SERVE };
struct mode {
    int control_fd; /* plain mode's --control-fd, else -1 */
    long long grace_ms; /* --grace-ms: a SIGTERM request is followed by SIGKILL after it; -1: never */
    /* The PROGRAM process was reaped; its exit record comes next. */
    void (*program_ended)(void);
    /* No child is left, said once. */
    void (*children_gone)(void);
    /* Each round once no child is left: END_EXIT (exit 0 now), END_AGAIN (go round at once), or
     * END_SERVE (output still to move: wait, but serve no more kill requests). NULL: `empty`, exit. */
    int (*ending)(void);
    /* The mode's fds, added to PFDS from NFDS; may lower *TIMEOUT (-1: none). Returns the new count,
     * or -1 to go round again without waiting. */
    int (*add_polls)(struct pollfd *pfds, int nfds, int no_children, int *timeout);
    /* After a poll that saw something: the mode's fds. */
    void (*serve_polls)(const struct pollfd *pfds);
    /* A kill request came as a signal. */
    void (*kill_asked)(void);
};

/* How PROGRAM is started. */
struct launch {
    char **program;
    char **env;         /* its whole environment */
    int stdio[3];       /* dup2()ed onto its fds 0-2; -1: it inherits the supervisor's */
    const char *slave;  /* a terminal to open as its fds 0-2 (and controlling terminal), or NULL */
    int own_terminal;   /* a terminal on fd 0 becomes its controlling terminal (status-fd modes) */
    int status_to;      /* >= 3: the program gets status_fd there too */
    int capture;        /* >= 0: the program gets this fd as capture_to (frame mode's --capture-fd) */
    int capture_to;
};

extern int sig_fd;
extern pid_t child_pid;         /* the PROGRAM process, -1 once reaped */
extern int want_term, want_kill; /* kill requests not yet served */

void clear_arguments(const struct options *o);
void take_signals(int files_written);
void parent_death_signal(void);
/* Field 22 of /proc/self/stat: with the pid, it names this process for good (`supervisor PID START`). */
unsigned long long own_start_time(void);
void prepare_supervisor(void);
/* seccomp.c: ioctl(TIOCSTI) and ioctl(TIOCLINUX) refused from here on (0), or the errno of the refusal. */
int refuse_terminal_injection(void);
void check_supervisor(int allow_no_subreaper);
char **command_environment(char **base, const struct options *o);
int spawn_command(const struct launch *l);
void settle_stdio(int first_fd, int control_fd);
void stdio_to_null(void);
int report_start(int pty_err, int exec_err);
int supervise(const struct mode *m);

int run_plain(struct options *o);
int run_framed(struct options *o);
int run_detached(struct options *o);
int run_fork_server(struct options *o);
int run_warm(const char *bash);

#endif
