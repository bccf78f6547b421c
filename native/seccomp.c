/*
 * No keystrokes into a terminal: a seccomp filter that refuses ioctl(TIOCSTI) and ioctl(TIOCLINUX)
 * with EPERM, to the supervisor and everything it starts (a filter is inherited across fork and exec
 * and cannot be removed).
 *
 * TIOCSTI pushes a byte into a terminal's input queue, as if typed; TIOCLINUX can paste a virtual
 * console's selection. The kernel allows TIOCSTI on a terminal other than the caller's controlling one
 * only with CAP_SYS_ADMIN, and a command runs in a session of its own, without the harness's terminal:
 * so it is a command running as root (or with that capability) that could type into the shell of the
 * person who started the agent. Exactly then the filter can be installed without no_new_privs, which
 * this supervisor never sets (it would break setuid programs such as sudo in every command). Without
 * CAP_SYS_ADMIN the install is refused (EACCES) and the kernel's own rule is what holds.
 *
 * Both ABIs of the architecture are covered: x86_64 (and its x32 numbering) with i386, aarch64 with
 * arm. The command argument is compared in its low 32 bits, as the terminal layer reads it.
 */
#include "common.h"
#include "supervisor.h"

#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>

#if defined(__x86_64__)
#define NATIVE_ARCH AUDIT_ARCH_X86_64
#define NATIVE_IOCTL 16
#define NATIVE_IOCTL_ALT (0x40000000 | 514) /* x32 */
#define COMPAT_ARCH AUDIT_ARCH_I386
#define COMPAT_IOCTL 54
#elif defined(__aarch64__)
#define NATIVE_ARCH AUDIT_ARCH_AARCH64
#define NATIVE_IOCTL 29
#define NATIVE_IOCTL_ALT 29
#define COMPAT_ARCH AUDIT_ARCH_ARM
#define COMPAT_IOCTL 54
#else
#error "dsh-supervise: no seccomp numbers for this architecture"
#endif

#ifndef TIOCLINUX
#define TIOCLINUX 0x541C
#endif

/* The low half of args[1] (little-endian on both architectures). */
#define ARG1_LOW offsetof(struct seccomp_data, args[1])

int refuse_terminal_injection(void)
{
    struct sock_filter filter[] = {
        /* 0 */ BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        /* 1 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NATIVE_ARCH, 0, 3),  /* -> 2, else 5 */
        /* 2 */ BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        /* 3 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NATIVE_IOCTL, 4, 0), /* -> 8 */
        /* 4 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NATIVE_IOCTL_ALT, 3, 6), /* -> 8, else 11 */
        /* 5 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, COMPAT_ARCH, 0, 5),  /* -> 6, else 11 */
        /* 6 */ BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        /* 7 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, COMPAT_IOCTL, 0, 3), /* -> 8, else 11 */
        /* 8 */ BPF_STMT(BPF_LD | BPF_W | BPF_ABS, ARG1_LOW),
        /* 9 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, TIOCSTI, 2, 0),      /* -> 12 */
        /* 10 */ BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, TIOCLINUX, 1, 0),   /* -> 12, else 11 */
        /* 11 */ BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        /* 12 */ BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
    };
    struct sock_fprog program = {.len = sizeof filter / sizeof filter[0], .filter = filter};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program, 0, 0) < 0)
        return errno;
    return 0;
}
