/*
 * --confine (version 10; --network: 11; --proxy PATH: 12; --proxy-key-env: 13): the sandbox policy's step (docs/design/policy.md). Exec'd in the command's own
 * process, before the command, it restricts itself and execs PROGRAM; what it applies is irreversible
 * and inherited by every child, and the supervisor that started it stays unconfined.
 *
 *   dsh-supervise --confine [--write PATH]... [--deny-read PATH]... [--cpu-seconds N] [--file-bytes N]
 *                 [--memory-bytes N] [--open-files N] [--processes N]
 *                 [--network none|loopback|allow-list --proxy @NAME|PATH [--proxy-key-env NAME]]
 *                 -- PROGRAM [ARGS...]
 *   dsh-supervise --confine --probe      (prints "landlock ABI" (0 where the kernel has none) and
 *                                         "loopback 1|0": whether --network loopback can hold here,
 *                                         "processes 1|0": whether --processes can)
 *
 * - Files, by Landlock (ABI 1 and later; the rights the running kernel knows are all handled): every
 *   path may be read and executed, and written (written, made, removed, renamed, truncated) only
 *   beneath a --write PATH. A --deny-read PATH may be neither read nor written: the rights are granted
 *   as an allow-list, and each directory on the way to a denied path gets only the right to be listed,
 *   its other entries the full grant (enumerated here, symlinks skipped: one resolves to its target's
 *   rules). So a link or /proc/self/root/... reaches a denied file without rights, and Landlock's
 *   REFER rule refuses a hard link that would give it more. The cost: a new entry made later directly
 *   in a directory on the way has no rights (listing only), and a hard link made before the command
 *   started is another path to the file (path-based rules cannot see it).
 * - Signals and abstract unix sockets (ABI 6): scoped, so the command cannot signal or connect to what
 *   runs outside its domain (its supervisor, the harness).
 * - no_new_privs first: Landlock needs it without CAP_SYS_ADMIN, and a setuid program must not shed
 *   the rules.
 * - Network (version 11). none: seccomp makes socket() fail with EACCES, unix sockets included (a
 *   socket file is reached by path, which no rule here can see; socketpair() stays): TCP, UDP, raw,
 *   netlink alike, DNS too; io_uring_setup too (its socket operation would pass
 *   by seccomp); a foreign architecture's system calls (int 0x80, x32) fail the same way. loopback:
 *   a new network namespace with nothing in it but its own loopback, brought up, made in a new user
 *   namespace (for root too: root of a child user namespace cannot setns back into the host's);
 *   the user's ids map to themselves (root: every id, so root's rights on files stay root's).
 *   Where no user namespace can be made (Docker's default seccomp profile), a namespace that has no
 *   interface but loopback already (a container without a network) holds the rule as it is; else
 *   the rule cannot be applied. allow-list: first a connection to the harness's egress proxy (the
 *   abstract unix socket --proxy @NAME, which exists in the harness's network namespace only), then
 *   loopback's network, and in it a forwarder (a child of the command's, ended by its parent's
 *   death) on 127.0.0.1:3128 that hands each connection it accepts to the proxy over that one
 *   connection (SCM_RIGHTS); HTTP_PROXY and its kin name the forwarder. Nothing in the command's
 *   network can reach the proxy but through it. In a network shared with other commands (version
 *   13: where none can be made) the forwarder takes another port when 3128 is taken and serves only
 *   this command's processes (egress.c). --proxy PATH (version 12; an absolute path: a unix
 *   socket's file, which an SSH server forwards to the harness's proxy one connection at a time, so
 *   no descriptor can be handed over): the forwarder copies each connection both ways through a
 *   connection of its own to PATH, in a process per connection (a child of the forwarder's, ended by
 *   its parent's death). PATH is reachable from the command's network as well (a file): it leads to
 *   the same proxy, and the file's mode (the SSH server's 0600) keeps other users out.
 *   --proxy-key-env NAME (version 13): the proxy's key (hex, 16-128 digits) is the environment
 *   variable NAME, removed from the environment before the network is made; each relay sends it,
 *   and a newline, before the first byte of its connection, and the proxy refuses a connection that
 *   does not begin with it. So a confined command that learns another list's PATH (a forwarder's
 *   command line shows it) cannot use that list: the key is in no file and no argument, the command
 *   never has it in its environment, and the processes whose memory or initial environment holds it
 *   (its supervisor, this step's forwarder and relays, which are not dumpable) are out of reach of
 *   a confined command (Landlock's ptrace scoping; a non-dumpable process needs CAP_SYS_PTRACE in
 *   the first user namespace). Not a file: denying a command a directory of keys would cost it
 *   making new entries in each directory on the way (/tmp on an SSH host).
 * - Processes (version 11): a pids cgroup of the command's own (cgroup v1's pids hierarchy, or v2
 *   with the pids controller), made beneath "dsh-bash" at the hierarchy's root, its pids.max N; the
 *   process moves itself in before anything else. Writable as root on a host; not inside a container
 *   (a read-only /sys/fs/cgroup). Empty cgroups that earlier commands left are removed by the next
 *   step (and the probe). A user other than root without a cgroup (version 12): RLIMIT_NPROC in a
 *   user namespace of the command's own (the network rule's where it makes one), where the kernel
 *   (5.14 and later) counts this command's processes only, not every process of the user as it
 *   would outside. Root is exempt from RLIMIT_NPROC: for root no cgroup means the rule cannot be
 *   applied, as it cannot where no user namespace can be made either.
 * - Limits, by setrlimit, soft and hard alike (raising a hard limit needs CAP_SYS_RESOURCE); CPU time's
 *   hard limit a second past the soft one (SIGXCPU, then SIGKILL).
 *
 * A PATH may start with ~/ (this process's HOME: the command's, where it runs). One that does not exist
 * is skipped (nothing to grant or to protect; under ~/ without a HOME, the same). Exit status: PROGRAM's (it
 * is exec'd); 125 for usage errors and for rules that cannot be applied (a message on stderr naming
 * the rule): the command never runs unconfined by mistake.
 */
#include "common.h"
#include "confine.h"
#include "egress.h"
#include <dirent.h>
#include <limits.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/un.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>

#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#endif
#ifndef SYS_landlock_add_rule
#define SYS_landlock_add_rule 445
#endif
#ifndef SYS_landlock_restrict_self
#define SYS_landlock_restrict_self 446
#endif

/* The kernel's ABI (linux/landlock.h), spelt out here: the toolchains' headers lag behind. */
#define LL_CREATE_RULESET_VERSION (1U << 0)
#define LL_RULE_PATH_BENEATH 1
#define LL_EXECUTE (1ULL << 0)
#define LL_WRITE_FILE (1ULL << 1)
#define LL_READ_FILE (1ULL << 2)
#define LL_READ_DIR (1ULL << 3)
#define LL_REFER (1ULL << 13)    /* ABI 2 */
#define LL_TRUNCATE (1ULL << 14) /* ABI 3 */
#define LL_IOCTL_DEV (1ULL << 15) /* ABI 5 */
#define LL_SCOPE_ABSTRACT_UNIX_SOCKET (1ULL << 0) /* ABI 6 */
#define LL_SCOPE_SIGNAL (1ULL << 1)               /* ABI 6 */
/* The rights a rule on a file (not a directory) may carry. */
#define LL_FILE_RIGHTS (LL_EXECUTE | LL_WRITE_FILE | LL_READ_FILE | LL_TRUNCATE | LL_IOCTL_DEV)
#define LL_READ_RIGHTS (LL_EXECUTE | LL_READ_FILE | LL_READ_DIR)

struct ll_ruleset_attr {
    uint64_t handled_access_fs;
    uint64_t handled_access_net;
    uint64_t scoped;
};

struct ll_path_beneath_attr {
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));

#define MAX_PATHS 64

static char *denied[MAX_PATHS];
static int denied_count;
static int ruleset_fd = -1;
static uint64_t handled;

int landlock_abi(void)
{
    long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, LL_CREATE_RULESET_VERSION);
    return abi < 0 ? 0 : (int)abi;
}

static uint64_t handled_for(int abi)
{
    uint64_t rights = (1ULL << 13) - 1; /* ABI 1: EXECUTE to MAKE_SYM */
    if (abi >= 2)
        rights |= LL_REFER;
    if (abi >= 3)
        rights |= LL_TRUNCATE;
    if (abi >= 5)
        rights |= LL_IOCTL_DEV;
    return rights;
}

/* PATH == DIR or PATH beneath DIR (both canonical). */
static int is_within(const char *path, const char *dir)
{
    size_t n = strlen(dir);
    if (strcmp(dir, "/") == 0)
        return 1;
    return strncmp(path, dir, n) == 0 && (path[n] == '\0' || path[n] == '/');
}

/* One rule: RIGHTS beneath PATH (a file's rule keeps the file rights only). A symlink gets none. */
static void add_rule(const char *path, uint64_t rights)
{
    int fd = open(path, O_PATH | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT || errno == ENOTDIR)
            return;
        die("--confine: cannot open %s: %s", path, strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st) < 0)
        die("--confine: cannot stat %s: %s", path, strerror(errno));
    if (S_ISLNK(st.st_mode)) {
        close(fd);
        return;
    }
    if (!S_ISDIR(st.st_mode))
        rights &= LL_FILE_RIGHTS;
    rights &= handled;
    if (rights != 0) {
        struct ll_path_beneath_attr beneath = {.allowed_access = rights, .parent_fd = fd};
        if (syscall(SYS_landlock_add_rule, ruleset_fd, LL_RULE_PATH_BENEATH, &beneath, 0) < 0)
            die("--confine: cannot add the rule for %s: %s", path, strerror(errno));
    }
    close(fd);
}

/* RIGHTS beneath PATH, except beneath a denied path: a directory on the way to one gets the right to
 * be listed only, and each of its entries (but the way on) the whole grant, and so on down. */
static void grant(const char *path, uint64_t rights)
{
    int on_the_way = 0;
    for (int i = 0; i < denied_count; i++) {
        if (is_within(path, denied[i]))
            return;
        if (is_within(denied[i], path))
            on_the_way = 1;
    }
    if (!on_the_way) {
        add_rule(path, rights);
        return;
    }
    add_rule(path, rights & LL_READ_DIR);
    DIR *dir = opendir(path);
    if (dir == NULL)
        return; /* nothing enumerated, nothing granted beneath: the safe side */
    struct dirent *entry;
    char child[PATH_MAX];
    while ((entry = readdir(dir)) != NULL) {
        if (strcmp(entry->d_name, ".") == 0 || strcmp(entry->d_name, "..") == 0)
            continue;
        int n = snprintf(child, sizeof child, "%s/%s", strcmp(path, "/") == 0 ? "" : path, entry->d_name);
        if (n < 0 || (size_t)n >= sizeof child)
            die("--confine: a path beneath %s is too long", path);
        grant(child, rights);
    }
    closedir(dir);
}

/* PATH made canonical (links resolved; a leading ~/ is this process's HOME); NULL for a path that does
 * not exist, or under ~/ without a HOME. */
static char *canonical(const char *path, const char *opt)
{
    char expanded[PATH_MAX];
    if (path[0] == '~' && (path[1] == '/' || path[1] == '\0')) {
        const char *home = getenv("HOME");
        if (home == NULL || home[0] != '/')
            return NULL;
        int n = snprintf(expanded, sizeof expanded, "%s%s", home, path + 1);
        if (n < 0 || (size_t)n >= sizeof expanded)
            die("--confine: %s %s: too long under HOME", opt, path);
        path = expanded;
    }
    if (path[0] != '/')
        die("--confine: %s wants an absolute path or one under ~/, not '%s'", opt, path);
    char *resolved = realpath(path, NULL);
    if (resolved == NULL && errno != ENOENT && errno != ENOTDIR)
        die("--confine: %s %s: %s", opt, path, strerror(errno));
    return resolved;
}

static rlim_t parse_limit(const char *s, const char *opt)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || s[0] == '-')
        die("--confine: %s wants a number, not '%s'", opt, s);
    return (rlim_t)v;
}

static void set_limit(int resource, rlim_t value, const char *opt)
{
    /* CPU time: SIGXCPU at the limit (a signal the model can read), SIGKILL a second later for a
     * command that ignores it; the kernel sends SIGKILL at once where the two are equal. */
    struct rlimit limit = {value, resource == RLIMIT_CPU && value != RLIM_INFINITY ? value + 1 : value};
    if (setrlimit(resource, &limit) < 0)
        die("--confine: %s %llu: %s", opt, (unsigned long long)value, strerror(errno));
}

/* --- network ---------------------------------------------------------------------------------- */

#if defined(__x86_64__)
#define THIS_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define THIS_AUDIT_ARCH AUDIT_ARCH_AARCH64
#else
#error "--network none: this architecture's seccomp filter is not written"
#endif
#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif

/* --network none: no socket at all (socketpair stays: it reaches nothing), and the ways around
 * seccomp's view closed. Unix sockets too: a socket file (a Docker engine's) is reached by its path,
 * which neither seccomp nor Landlock (to ABI 7) can tell apart. */
static void refuse_sockets(void)
{
    struct sock_filter program[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, THIS_AUDIT_ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EACCES), /* int 0x80 and the like */
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000, 0, 1), /* x32's numbers */
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EACCES),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EACCES),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_socket, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EACCES),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog filter = {.len = sizeof program / sizeof program[0], .filter = program};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &filter, 0, 0) < 0)
        die("--confine: --network none: cannot install the seccomp filter: %s", strerror(errno));
}

/* Whether this network namespace has no interface but loopback. */
static int only_loopback(void)
{
    struct if_nameindex *names = if_nameindex();
    if (names == NULL)
        return 0;
    int only = 1;
    for (struct if_nameindex *n = names; n->if_index != 0 || n->if_name != NULL; n++)
        if (strcmp(n->if_name, "lo") != 0)
            only = 0;
    if_freenameindex(names);
    return only;
}

static int write_text(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = write(fd, text, strlen(text));
    int saved = errno;
    close(fd);
    errno = saved;
    return n == (ssize_t)strlen(text) ? 0 : -1;
}

/* Root's ids, every one of them, mapped for process TARGET once it has made its namespace: written by
 * a child that stays in the parent namespace (a process may map no more than its own id for itself).
 * Returns the helper's pid; it maps when GO is written to, and does nothing on EOF. */
static pid_t root_mapper(int *go)
{
    int pipe_fds[2];
    if (pipe2(pipe_fds, O_CLOEXEC) < 0)
        die("--confine: --network loopback: pipe: %s", strerror(errno));
    pid_t target = getpid(), pid = fork();
    if (pid < 0)
        die("--confine: --network loopback: fork: %s", strerror(errno));
    if (pid == 0) {
        close(pipe_fds[1]);
        char byte, path[64];
        if (read(pipe_fds[0], &byte, 1) != 1)
            _exit(2);
        snprintf(path, sizeof path, "/proc/%d/uid_map", (int)target);
        if (write_text(path, "0 0 4294967295") < 0)
            _exit(1);
        snprintf(path, sizeof path, "/proc/%d/gid_map", (int)target);
        _exit(write_text(path, "0 0 4294967295") < 0 ? 1 : 0);
    }
    close(pipe_fds[0]);
    *go = pipe_fds[1];
    return pid;
}

static int reaped_status(pid_t pid)
{
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

/* Whether this process made a user namespace of its own (for the network, or to count processes). */
static int in_own_user_namespace;

/* A new user namespace (and what FLAGS add), this process's ids mapped to themselves (root's: every
 * id); -1 (errno set) where none can be made. WHAT names the rule in a message. Dies when one was
 * made but cannot be set up: a half-made namespace never runs the command. */
static int new_user_namespace(int flags, const char *what)
{
    uid_t uid = geteuid();
    gid_t gid = getegid();
    int go = -1;
    pid_t mapper = uid == 0 ? root_mapper(&go) : 0;
    if (unshare(CLONE_NEWUSER | flags) < 0) {
        int why = errno;
        if (mapper > 0) {
            close(go);
            reaped_status(mapper);
        }
        errno = why;
        return -1;
    }
    in_own_user_namespace = 1;
    char map[64];
    if (uid == 0) {
        ssize_t said = write(go, "m", 1);
        close(go);
        if (said != 1 || reaped_status(mapper) != 0)
            die("--confine: %s: cannot map root's ids in the new user namespace", what);
    } else {
        /* The maps are files of this process, owned by root while it is not dumpable (supervise.c
         * makes every mode so): dumpable for these three writes, then not again. */
        if (prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) < 0)
            die("--confine: prctl(PR_SET_DUMPABLE): %s", strerror(errno));
        snprintf(map, sizeof map, "%u %u 1", (unsigned)uid, (unsigned)uid);
        if (write_text("/proc/self/uid_map", map) < 0)
            die("--confine: %s: cannot map uid %u: %s", what, (unsigned)uid, strerror(errno));
        if (write_text("/proc/self/setgroups", "deny") < 0 && errno != ENOENT)
            die("--confine: %s: cannot deny setgroups: %s", what, strerror(errno));
        snprintf(map, sizeof map, "%u %u 1", (unsigned)gid, (unsigned)gid);
        if (write_text("/proc/self/gid_map", map) < 0)
            die("--confine: %s: cannot map gid %u: %s", what, (unsigned)gid, strerror(errno));
        if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0)
            die("--confine: prctl(PR_SET_DUMPABLE): %s", strerror(errno));
    }
    return 0;
}

/* A new user and network namespace, loopback up; -1 (errno set) where none can be made. */
static int new_loopback_namespace(void)
{
    if (new_user_namespace(CLONE_NEWNET, "--network loopback") < 0)
        return -1;
    int sock = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq lo;
    memset(&lo, 0, sizeof lo);
    strcpy(lo.ifr_name, "lo");
    if (sock < 0 || ioctl(sock, SIOCGIFFLAGS, &lo) < 0)
        die("--confine: --network loopback: cannot read loopback's flags: %s", strerror(errno));
    lo.ifr_flags |= IFF_UP;
    if (ioctl(sock, SIOCSIFFLAGS, &lo) < 0)
        die("--confine: --network loopback: cannot bring loopback up: %s", strerror(errno));
    close(sock);
    return 0;
}

/* Returns 1 where the network is the command's own, 0 where it shares one that has only loopback. */
static int loopback_only(void)
{
    if (new_loopback_namespace() == 0)
        return 1;
    int why = errno;
    if (!only_loopback())
        die("--confine: --network loopback: no network namespace can be made here (%s) and this one "
            "has interfaces besides loopback",
            strerror(why));
    return 0;
}

/* Whether --network loopback can hold here: a child tries (the probe itself stays as it was). */
static int loopback_possible(void)
{
    if (only_loopback())
        return 1;
    pid_t pid = fork();
    if (pid < 0)
        return 0;
    if (pid == 0)
        _exit(unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0 ? 0 : 1);
    return reaped_status(pid) == 0;
}

/* --- processes: a pids cgroup of the command's own --------------------------------------------- */

/* The pids controller's hierarchy as this process sees it: its mount point in ROOT (v1: a cgroup
 * mount whose options name pids; v2: a cgroup2 mount whose cgroup.controllers lists pids); V2 set
 * for the second. 0 when there is none. */
static int pids_hierarchy(char *root, size_t size, int *v2)
{
    FILE *mounts = fopen("/proc/self/mountinfo", "re");
    if (mounts == NULL)
        return 0;
    char line[4096];
    int found = 0;
    while (!found && fgets(line, sizeof line, mounts) != NULL) {
        char *dash = strstr(line, " - ");
        if (dash == NULL)
            continue;
        char point[PATH_MAX], fstype[64], source[256], options[1024];
        if (sscanf(line, "%*s %*s %*s %*s %4095s", point) != 1)
            continue;
        if (sscanf(dash + 3, "%63s %255s %1023s", fstype, source, options) != 3)
            continue;
        if (strcmp(fstype, "cgroup") == 0) {
            for (char *save = NULL, *word = strtok_r(options, ",", &save); word != NULL;
                 word = strtok_r(NULL, ",", &save))
                if (strcmp(word, "pids") == 0)
                    found = 1;
            *v2 = 0;
        } else if (strcmp(fstype, "cgroup2") == 0) {
            char controllers[PATH_MAX + 32], listed[512] = "";
            snprintf(controllers, sizeof controllers, "%s/cgroup.controllers", point);
            FILE *f = fopen(controllers, "re");
            if (f != NULL) {
                if (fgets(listed, sizeof listed, f) != NULL)
                    for (char *save = NULL, *word = strtok_r(listed, " \n", &save); word != NULL;
                         word = strtok_r(NULL, " \n", &save))
                        if (strcmp(word, "pids") == 0)
                            found = 1;
                fclose(f);
            }
            *v2 = 1;
        }
        if (found && (size_t)snprintf(root, size, "%s", point) >= size)
            found = 0;
    }
    fclose(mounts);
    return found;
}

/* "+pids" into a v2 cgroup's subtree_control, unless it is there already. */
static int enable_pids_below(const char *cgroup)
{
    char path[PATH_MAX], listed[512] = "";
    snprintf(path, sizeof path, "%s/cgroup.subtree_control", cgroup);
    FILE *f = fopen(path, "re");
    if (f != NULL) {
        if (fgets(listed, sizeof listed, f) == NULL)
            listed[0] = '\0';
        fclose(f);
    }
    for (char *save = NULL, *word = strtok_r(listed, " \n", &save); word != NULL; word = strtok_r(NULL, " \n", &save))
        if (strcmp(word, "pids") == 0)
            return 0;
    return write_text(path, "+pids");
}

/* The directory the commands' pids cgroups live in (made once, shared: "dsh-bash" at the hierarchy's
 * root), in BASE; -1 (errno set) where it cannot be made or used. Empty ones that commands left are
 * removed first (a cgroup with a live process in it refuses rmdir: EBUSY). */
static int pids_base(char *base, size_t size)
{
    char root[PATH_MAX];
    int v2 = 0;
    if (!pids_hierarchy(root, sizeof root, &v2)) {
        errno = ENOENT;
        return -1;
    }
    if ((size_t)snprintf(base, size, "%s/dsh-bash", root) >= size) {
        errno = ENAMETOOLONG;
        return -1;
    }
    if (v2 && enable_pids_below(root) < 0)
        return -1;
    if (mkdir(base, 0755) < 0 && errno != EEXIST)
        return -1;
    if (v2 && enable_pids_below(base) < 0)
        return -1;
    DIR *dir = opendir(base);
    if (dir != NULL) {
        struct dirent *entry;
        char stale[PATH_MAX];
        while ((entry = readdir(dir)) != NULL)
            if (strncmp(entry->d_name, "cmd-", 4) == 0 &&
                (size_t)snprintf(stale, sizeof stale, "%s/%s", base, entry->d_name) < sizeof stale)
                rmdir(stale);
        closedir(dir);
    }
    return 0;
}

/* A fresh cgroup beneath BASE for this command; its path in OUT. */
static int new_pids_cgroup(const char *base, const char *prefix, char *out, size_t size)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    snprintf(out, size, "%s/%s-%d-%lld%09ld", base, prefix, (int)getpid(), (long long)now.tv_sec, now.tv_nsec);
    return mkdir(out, 0755);
}

/* --processes N: this process (and so the command and all it starts) in a pids cgroup of its own
 * whose pids.max is N; fork fails with EAGAIN past it. A sweep by another command's step may remove
 * the fresh cgroup before this one joins it: tried again. Returns 0 then; 1 where no cgroup can be
 * made but a user other than root can count its processes by a user namespace instead (see
 * count_processes_in_own_namespace); dies where neither can hold. */
static int limit_processes(const char *value)
{
    char base[PATH_MAX], cgroup[PATH_MAX], file[PATH_MAX + 32], pid[32];
    if (pids_base(base, sizeof base) < 0) {
        if (geteuid() != 0)
            return 1;
        die("--confine: --processes: no pids cgroup can be made here: %s", strerror(errno));
    }
    snprintf(pid, sizeof pid, "%d", (int)getpid());
    for (int attempt = 0;; attempt++) {
        if (new_pids_cgroup(base, "cmd", cgroup, sizeof cgroup) < 0) {
            if (geteuid() != 0 && attempt == 0)
                return 1;
            die("--confine: --processes: no pids cgroup can be made here (in %s: %s)", base, strerror(errno));
        }
        snprintf(file, sizeof file, "%s/pids.max", cgroup);
        int set = write_text(file, value);
        snprintf(file, sizeof file, "%s/cgroup.procs", cgroup);
        if (set == 0 && write_text(file, pid) == 0)
            return 0;
        if (geteuid() != 0 && attempt == 0 && errno != ENOENT) {
            rmdir(cgroup);
            return 1;
        }
        if (errno != ENOENT || attempt == 4)
            die("--confine: --processes: cannot put this command in %s: %s", cgroup, strerror(errno));
    }
}

/* --processes N for a user other than root without a cgroup: RLIMIT_NPROC, counted in a user
 * namespace of the command's own. Since Linux 5.14 the count is kept per user namespace (each level
 * its own, the limit checked at each), so in a fresh one it holds this command's processes only,
 * not every process of the user as it would outside; a nested namespace still counts at this one.
 * Root is never held by RLIMIT_NPROC (the kernel exempts uid 0), nor can the command raise it
 * (CAP_SYS_RESOURCE in the first namespace). After the network rule, whose namespace serves. */
static void count_processes_in_own_namespace(const char *value)
{
    if (!in_own_user_namespace && new_user_namespace(0, "--processes") < 0)
        die("--confine: --processes: neither a pids cgroup nor a user namespace can be made here: %s",
            strerror(errno));
    set_limit(RLIMIT_NPROC, parse_limit(value, "--processes"), "--processes");
}

/* Whether --processes can hold here: a cgroup made and removed again; for a user other than root,
 * else a user namespace (a child tries). */
static int processes_possible(void)
{
    char base[PATH_MAX], cgroup[PATH_MAX], limit[PATH_MAX + 32];
    if (pids_base(base, sizeof base) == 0 && new_pids_cgroup(base, "probe", cgroup, sizeof cgroup) == 0) {
        snprintf(limit, sizeof limit, "%s/pids.max", cgroup);
        int ok = access(limit, W_OK) == 0;
        rmdir(cgroup);
        if (ok)
            return 1;
    }
    if (geteuid() == 0)
        return 0;
    pid_t pid = fork();
    if (pid < 0)
        return 0;
    if (pid == 0)
        _exit(unshare(CLONE_NEWUSER) == 0 ? 0 : 1);
    return reaped_status(pid) == 0;
}

int run_confine(int argc, char **argv)
{
    char *writable[MAX_PATHS];
    int writable_count = 0, i = 2; /* argv[1] is --confine */
    const char *network = NULL, *processes = NULL, *proxy = NULL, *key_name = NULL;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) {
            i++;
            break;
        }
        if (strcmp(a, "--probe") == 0 && argc == 3) {
            printf("landlock %d\nloopback %d\nprocesses %d\n", landlock_abi(), loopback_possible(),
                   processes_possible());
            return 0;
        }
        if (i + 1 >= argc)
            die("--confine: %s wants a value", a);
        const char *v = argv[++i];
        if (strcmp(a, "--write") == 0 || strcmp(a, "--deny-read") == 0) {
            int deny = a[2] == 'd';
            if ((deny ? denied_count : writable_count) == MAX_PATHS)
                die("--confine: at most %d %s paths", MAX_PATHS, a);
            char *path = canonical(v, a);
            if (path != NULL) {
                if (deny)
                    denied[denied_count++] = path;
                else
                    writable[writable_count++] = path;
            }
        } else if (strcmp(a, "--cpu-seconds") == 0) {
            set_limit(RLIMIT_CPU, parse_limit(v, a), a);
        } else if (strcmp(a, "--file-bytes") == 0) {
            set_limit(RLIMIT_FSIZE, parse_limit(v, a), a);
        } else if (strcmp(a, "--memory-bytes") == 0) {
            set_limit(RLIMIT_AS, parse_limit(v, a), a);
        } else if (strcmp(a, "--open-files") == 0) {
            set_limit(RLIMIT_NOFILE, parse_limit(v, a), a);
        } else if (strcmp(a, "--processes") == 0) {
            parse_limit(v, a);
            processes = v;
        } else if (strcmp(a, "--network") == 0) {
            if (strcmp(v, "none") != 0 && strcmp(v, "loopback") != 0 && strcmp(v, "allow-list") != 0)
                die("--confine: --network wants none, loopback or allow-list, not '%s'", v);
            network = v;
        } else if (strcmp(a, "--proxy") == 0) {
            proxy = v;
        } else if (strcmp(a, "--proxy-key-env") == 0) {
            key_name = v;
        } else {
            die("--confine: %s is not one of its options", a);
        }
    }
    if (i >= argc)
        die("usage: dsh-supervise --confine [--write PATH]... [--deny-read PATH]... [--cpu-seconds N] "
            "[--file-bytes N] [--memory-bytes N] [--open-files N] [--processes N] "
            "[--network none|loopback|allow-list --proxy @NAME|PATH [--proxy-key-env NAME]] -- PROGRAM [ARGS...]\n"
            "       dsh-supervise --confine --probe");
    /* The cgroup first: its files are written before a user namespace would make them another's. */
    int count_in_namespace = processes != NULL && limit_processes(processes);
    int allow_list = network != NULL && strcmp(network, "allow-list") == 0;
    if (allow_list != (proxy != NULL))
        die("--confine: --network allow-list and --proxy @NAME|PATH go together");
    if (key_name != NULL && (proxy == NULL || proxy[0] != '/'))
        die("--confine: --proxy-key-env goes with --proxy PATH (a socket file; an abstract socket needs none)");
    if (key_name != NULL)
        take_proxy_key(key_name);
    int control = allow_list ? connect_proxy(proxy) : -1; /* still in the harness's network */
    int own_network = 1;
    if (network != NULL && (strcmp(network, "loopback") == 0 || allow_list))
        own_network = loopback_only();
    if (count_in_namespace)
        count_processes_in_own_namespace(processes);
    int abi = landlock_abi();
    if (abi < 1)
        die("--confine: this kernel has no Landlock (or it is disabled): the file rules cannot be applied");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        die("--confine: prctl(PR_SET_NO_NEW_PRIVS): %s", strerror(errno));
    handled = handled_for(abi);
    struct ll_ruleset_attr attr = {.handled_access_fs = handled};
    if (abi >= 6)
        attr.scoped = LL_SCOPE_ABSTRACT_UNIX_SOCKET | LL_SCOPE_SIGNAL;
    ruleset_fd = (int)syscall(SYS_landlock_create_ruleset, &attr, sizeof attr, 0);
    if (ruleset_fd < 0)
        die("--confine: landlock_create_ruleset: %s", strerror(errno));
    grant("/", LL_READ_RIGHTS);
    for (int w = 0; w < writable_count; w++)
        grant(writable[w], handled);
    if (syscall(SYS_landlock_restrict_self, ruleset_fd, 0) < 0)
        die("--confine: landlock_restrict_self: %s", strerror(errno));
    close(ruleset_fd);
    if (network != NULL && strcmp(network, "none") == 0)
        refuse_sockets();
    if (allow_list) {
        set_proxy_variables(start_forwarder(control, proxy, own_network));
    }
    execvp(argv[i], argv + i);
    die("--confine: cannot run %s: %s", argv[i], strerror(errno));
}
