/*
 * dsh-supervise: a per-command subreaper for dsh-bash.
 *
 *   dsh-supervise [--status-fd N] [--control-fd N] [--die-with-parent] [--allow-no-subreaper]
 *                 [--setenv NAME=VALUE]... -- PROGRAM [ARGS...]
 *   dsh-supervise --frame [--tty ROWSxCOLS | --stdin-null] [--capture-fd N] [--allow-no-subreaper]
 *                 [--grace-ms N] [--setenv NAME=VALUE]... -- PROGRAM [ARGS...]
 *   dsh-supervise --frame --spec [--allow-no-subreaper]
 *   dsh-supervise --detach --status-file PATH [--stdin-file PATH] [--stdout-file PATH]
 *                 [--stderr-file PATH] [--cap-bytes N [--cap-file PATH]] [--allow-no-subreaper]
 *                 [--setenv NAME=VALUE]...
 *                 -- PROGRAM [ARGS...]
 *   dsh-supervise --fork-server [--die-with-parent] [--allow-no-subreaper]
 *   dsh-supervise --warm BASH    (an SSH warm channel's waiter: warm.c)
 *   --self-fd N (version 7, with --frame or --detach): it was exec'd from N, the sealed copy of itself
 *                 that --warm left to BOOT; N is closed on the command's exec, and the process takes
 *                 the name of ARGV[0]'s last component (the kernel named it after the fd, "N")
 *   --capture-fd N (version 8, --frame; with --spec the payload's second string): the command gets a
 *                 pipe at fd N whose bytes come back as 'v' frames (framed.c)
 *   dsh-supervise --read-file PATH --max-bytes N
 *   dsh-supervise --write-file PATH --temp-name NAME --size N [--make-parents]
 *                 (version 9: a file read or written as this process's user, files.c)
 *   dsh-supervise --confine [--write PATH]... [--deny-read PATH]... [--cpu-seconds N] [--file-bytes N]
 *                 [--memory-bytes N] [--open-files N] [--network none|loopback] -- PROGRAM [ARGS...]
 *   dsh-supervise --confine --probe
 *                 (version 10, --network 11: the sandbox policy's step, exec'd before the command: confine.c)
 *   dsh-supervise --version      (prints "dsh-supervise 11": the protocol's version)
 *   dsh-supervise --sha256 | --hmac-sha256 KEYHEX   (digest of stdin in hex: for the tests)
 *
 * It makes itself a child subreaper and non-dumpable, forks PROGRAM into a session and process group
 * of its own, reports what happens on the status fd (ASCII lines, one write(2) each), reaps every
 * process that ends up as its child (orphaned descendants re-parent to it), kills its whole subtree
 * on request, and exits 0 once it has no children left.
 *
 * The status records, the kill requests and how PROGRAM is started are in supervisor.c; each mode
 * keeps its protocol at the top of its own file: --frame in framed.c, --detach in detach.c,
 * --fork-server in forkserver.c. native/README.md says the same at length.
 *
 * --setenv NAME=VALUE (version 4, repeatable, every mode): the child sets NAME to VALUE (replacing any
 * inherited value; a later --setenv of the same NAME wins) right before it execs PROGRAM. The
 * supervisor's own environment is left as it was: a variable meant for the command alone (the
 * harness's marker, which a kill by marker looks for in /proc/PID/environ) never marks the
 * supervisor, and it costs no `env` exec in between. The values are copied before the argument area
 * is cleared, so /proc/PID/cmdline of the supervisor shows none of them either. No '=' or an empty
 * NAME: 125. A setenv(3) that fails in the child is reported as an exec failure (`execfail ERRNO`).
 *
 * --allow-no-subreaper: where PR_SET_CHILD_SUBREAPER is refused (qemu-user emulates no such prctl), go
 * on after `warning no-subreaper ERRNO` instead of failing; orphans then escape to init. For tests.
 *
 * Exit status: 0 after `empty`; 125 for usage and setup errors (a message on stderr).
 */
#include "common.h"
#include "confine.h"
#include "files.h"
#include "pty.h"
#include "sha256.h"
#include "supervisor.h"

enum run { RUN_PLAIN, RUN_FRAMED, RUN_DETACHED, RUN_FORK_SERVER };

/* The command line as given: which mode, and what goes with what (checked by check_options). */
struct command_line {
    int frame, detach, server;
    int first; /* argv index of PROGRAM */
};

static int parse_fd(const char *s, const char *opt)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *s == '\0' || *end != '\0' || v < 3 || v > 1000000)
        die("%s wants a file descriptor number of 3 or more, not '%s'", opt, s);
    if (fcntl((int)v, F_GETFD) < 0)
        die("%s %ld: not an open file descriptor", opt, v);
    if (fcntl((int)v, F_SETFD, FD_CLOEXEC) < 0)
        die("%s %ld: cannot set close-on-exec: %s", opt, v, strerror(errno));
    return (int)v;
}

static void usage(void) __attribute__((noreturn));
static void usage(void)
{
    die("usage: dsh-supervise [--status-fd N] [--control-fd N] [--die-with-parent] [--allow-no-subreaper] "
        "[--setenv NAME=VALUE]... -- PROGRAM [ARGS...]\n"
        "       dsh-supervise --frame [--tty ROWSxCOLS] [--capture-fd N] [--allow-no-subreaper] [--setenv NAME=VALUE]... -- PROGRAM "
        "[ARGS...]\n"
        "       dsh-supervise --frame --spec [--allow-no-subreaper]\n"
        "       dsh-supervise --detach --status-file PATH [--stdin-file PATH] [--stdout-file PATH] "
        "[--stderr-file PATH] [--allow-no-subreaper] [--setenv NAME=VALUE]... -- PROGRAM [ARGS...]\n"
        "       dsh-supervise --fork-server [--die-with-parent] [--allow-no-subreaper]\n"
        "       dsh-supervise --warm BASH\n"
        "       (--self-fd N, with --frame or --detach: exec'd from the sealed copy --warm left on N)");
}

/* The options that take a value (I is at the option; it moves past the value). 0: not one of them. */
static int parse_valued(int argc, char **argv, int *i, struct options *o, int *setenv_args)
{
    const char *a = argv[*i];
    if (*i + 1 >= argc)
        return 0;
    char *v = argv[*i + 1];
    if (strcmp(a, "--status-fd") == 0) {
        o->status_fd = parse_fd(v, a);
    } else if (strcmp(a, "--capture-fd") == 0) {
        /* A number the command gets, not one of ours: only its range is checked. */
        char *end;
        errno = 0;
        long n = strtol(v, &end, 10);
        if (errno != 0 || end == v || *end != '\0' || n < 3 || n > 1023)
            die("--capture-fd wants a file descriptor number from 3 to 1023");
        o->capture_fd = (int)n;
    } else if (strcmp(a, "--control-fd") == 0) {
        o->control_fd = parse_fd(v, a);
    } else if (strcmp(a, "--tty") == 0) {
        if (parse_size(v, strlen(v), 'x', &o->tty_rows, &o->tty_cols) != 0)
            die("--tty wants ROWSxCOLS, each a number from 1 to 65535");
    } else if (strcmp(a, "--status-file") == 0) {
        o->status_path = v; /* copied later, before the argument area is cleared */
    } else if (strcmp(a, "--stdin-file") == 0) {
        o->stdio_paths[0] = v;
    } else if (strcmp(a, "--stdout-file") == 0) {
        o->stdio_paths[1] = v;
    } else if (strcmp(a, "--stderr-file") == 0) {
        o->stdio_paths[2] = v;
    } else if (strcmp(a, "--cap-bytes") == 0) {
        char *end;
        errno = 0;
        o->cap_bytes = strtoll(v, &end, 10);
        if (errno != 0 || end == v || *end != '\0' || o->cap_bytes < 2 * 4096)
            die("--cap-bytes wants a number of bytes, at least 8192");
    } else if (strcmp(a, "--grace-ms") == 0) {
        char *end;
        errno = 0;
        o->grace_ms = strtoll(v, &end, 10);
        if (errno != 0 || end == v || *end != '\0' || o->grace_ms < 0 || o->grace_ms > 86400000)
            die("--grace-ms wants a number of milliseconds, from 0 to 86400000");
    } else if (strcmp(a, "--warm") == 0) {
        o->warm_bash = v;
    } else if (strcmp(a, "--self-fd") == 0) {
        /* The sealed copy of this binary it was exec'd from (warm.c): not the command's to inherit. */
        parse_fd(v, "--self-fd");
        o->self_fd = 1;
    } else if (strcmp(a, "--cap-file") == 0) {
        o->cap_path = v;
    } else if (strcmp(a, "--setenv") == 0) {
        /* The argument is not shown: its value may be meant for the command's eyes alone. */
        const char *eq = strchr(v, '=');
        if (eq == NULL || eq == v)
            die("--setenv wants NAME=VALUE with a non-empty NAME");
        setenv_args[o->setenv_count++] = *i + 1;
    } else {
        return 0;
    }
    (*i)++;
    return 1;
}

/* Reads the options up to PROGRAM. --version and the digest test aids answer here and exit. */
static void parse_options(int argc, char **argv, struct command_line *c, struct options *o, int *setenv_args)
{
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        } else if (parse_valued(argc, argv, &i, o, setenv_args)) {
            continue;
        } else if (strcmp(a, "--die-with-parent") == 0) {
            o->die_with_parent = 1;
        } else if (strcmp(a, "--frame") == 0) {
            c->frame = 1;
        } else if (strcmp(a, "--spec") == 0) {
            o->spec = 1;
        } else if (strcmp(a, "--stdin-null") == 0) {
            o->stdin_null = 1;
        } else if (strcmp(a, "--detach") == 0) {
            c->detach = 1;
        } else if (strcmp(a, "--fork-server") == 0) {
            c->server = 1;
        } else if (strcmp(a, "--sha256") == 0) {
            exit(digest_stdin(NULL));
        } else if (strcmp(a, "--hmac-sha256") == 0 && i + 1 < argc) {
            exit(digest_stdin(argv[i + 1]));
        } else if (strcmp(a, "--allow-no-subreaper") == 0) {
            o->allow_no_subreaper = 1;
        } else if (strcmp(a, "--version") == 0) {
            printf("dsh-supervise " VERSION "\n");
            exit(0);
        } else if (a[0] == '-') {
            usage();
        } else {
            break;
        }
    }
    c->first = i;
}

/* What goes with what: 125 with a message for any other combination. */
static void check_options(const struct command_line *c, const struct options *o, int argc)
{
    int has_program = c->first < argc;
    if (c->server && (c->frame || c->detach || o->status_fd >= 0 || o->control_fd >= 0 || has_program))
        die("--fork-server takes its requests from fd 0 and runs the programs they name: it goes with none "
            "of --frame, --detach, --status-fd, --control-fd, nor a PROGRAM");
    if (o->spec && (!c->frame || has_program || o->setenv_count > 0 || o->tty_rows > 0))
        die("--spec goes with --frame, and takes the PROGRAM, its --setenv entries and its terminal (no --tty) "
            "from fd 0");
    if (o->stdin_null && (!c->frame || o->tty_rows > 0))
        die("--stdin-null goes with --frame and no --tty: the command's stdin is /dev/null, not a pipe");
    if (o->capture_fd >= 0 && (!c->frame || o->spec))
        die("--capture-fd goes with --frame (with --spec the payload names it)");
    if (o->tty_rows > 0 && !c->frame)
        die("--tty goes with --frame: the supervisor holds the terminal's master and relays it");
    if (o->warm_bash != NULL
        && (c->frame || c->detach || c->server || has_program || o->status_fd >= 0 || o->control_fd >= 0
            || o->setenv_count > 0 || o->grace_ms >= 0 || o->die_with_parent || o->self_fd))
        die("--warm BASH waits for one request on fd 0 and execs BASH with it: it goes with no other option "
            "and no PROGRAM");
    if (!has_program && !c->server && !o->spec && o->warm_bash == NULL)
        usage();
    if (o->self_fd && !c->frame && !c->detach)
        die("--self-fd goes with --frame or --detach: a command's supervisor exec'd from --warm's sealed copy");
    if (c->frame && (o->status_fd >= 0 || o->control_fd >= 0 || o->die_with_parent))
        die("--frame takes its requests from fd 0 and writes its records to fd 1: it goes with none of "
            "--status-fd, --control-fd, --die-with-parent");
    if (c->detach && (c->frame || o->status_fd >= 0 || o->control_fd >= 0 || o->die_with_parent))
        die("--detach writes its records to --status-file and takes requests as signals: it goes with none "
            "of --frame, --status-fd, --control-fd, --die-with-parent");
    if (c->detach && o->status_path == NULL)
        die("--detach needs --status-file PATH");
    if (!c->detach && (o->status_path || o->stdio_paths[0] || o->stdio_paths[1] || o->stdio_paths[2]))
        die("--status-file, --stdin-file, --stdout-file and --stderr-file go with --detach only");
    if (o->cap_bytes >= 0 && (!c->detach || o->stdio_paths[1] == NULL || o->stdio_paths[2] == NULL))
        die("--cap-bytes goes with --detach, --stdout-file and --stderr-file");
    if (c->server && o->grace_ms >= 0)
        die("--grace-ms goes with a PROGRAM: --fork-server's requests carry no grace");
    if (o->cap_path != NULL && o->cap_bytes < 0)
        die("--cap-file goes with --cap-bytes");
}

static char *copy(const char *s)
{
    char *c = s != NULL ? strdup(s) : NULL;
    if (s != NULL && c == NULL)
        die("out of memory");
    return c;
}

/* Everything that points into the argument area is copied before the mode clears it: the paths, the
 * command, and NAME and VALUE of each --setenv, which are the child's alone (the supervisor's own
 * environment stays as it was: nothing marks it as one of the command's processes). */
static void copy_arguments(struct options *o, int first, const int *setenv_args)
{
    o->cap_path = copy(o->cap_path);
    o->status_path = copy(o->status_path);
    for (int k = 0; k < 3; k++)
        o->stdio_paths[k] = copy(o->stdio_paths[k]);
    int program_argc = o->argc - first;
    o->program = calloc((size_t)program_argc + 1, sizeof *o->program);
    if (o->program == NULL)
        die("out of memory");
    for (int k = 0; k < program_argc; k++)
        o->program[k] = copy(o->argv[first + k]);
    o->setenv_names = calloc((size_t)o->setenv_count + 1, sizeof *o->setenv_names);
    o->setenv_values = calloc((size_t)o->setenv_count + 1, sizeof *o->setenv_values);
    if (o->setenv_names == NULL || o->setenv_values == NULL)
        die("out of memory");
    for (int k = 0; k < o->setenv_count; k++) {
        const char *arg = o->argv[setenv_args[k]];
        const char *eq = strchr(arg, '=');
        o->setenv_names[k] = strndup(arg, (size_t)(eq - arg));
        o->setenv_values[k] = copy(eq + 1);
        if (o->setenv_names[k] == NULL)
            die("out of memory");
    }
}

int main(int argc, char **argv)
{
    /* First of all: from here on no process of the same user can read this one's memory (the
     * --detach key) or open its fds through /proc, nor ptrace it. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0)
        die("prctl(PR_SET_DUMPABLE): %s", strerror(errno));
    if (argc > 1 && (strcmp(argv[1], "--read-file") == 0 || strcmp(argv[1], "--write-file") == 0))
        return run_file_mode(argc, argv); /* no command, no supervision: files.c */
    if (argc > 1 && strcmp(argv[1], "--confine") == 0)
        return run_confine(argc, argv); /* the command's own process, before it: confine.c */
    struct options o = {
        .status_fd = -1, .control_fd = -1, .cap_bytes = -1, .grace_ms = -1, .capture_fd = -1, .argc = argc, .argv = argv};
    struct command_line c = {0, 0, 0, 1};
    /* --setenv: indexes into argv, copied once the options are known. */
    int *setenv_args = calloc((size_t)argc, sizeof *setenv_args);
    if (setenv_args == NULL)
        die("out of memory");
    parse_options(argc, argv, &c, &o, setenv_args);
    check_options(&c, &o, argc);
    copy_arguments(&o, c.first, setenv_args);
    free(setenv_args);
    if (o.self_fd) {
        /* Exec'd as /proc/self/fd/N: the kernel named the process "N". Those who look for supervisors
         * by name (the continue and thaw scripts) find it by its usual one. */
        const char *slash = strrchr(argv[0], '/');
        if (prctl(PR_SET_NAME, slash != NULL ? slash + 1 : argv[0], 0, 0, 0) < 0)
            die("prctl(PR_SET_NAME): %s", strerror(errno));
    }
    if (o.warm_bash != NULL)
        return run_warm(o.warm_bash);
    if (c.server)
        return run_fork_server(&o);
    if (c.detach)
        return run_detached(&o);
    if (c.frame)
        return run_framed(&o);
    return run_plain(&o);
}
