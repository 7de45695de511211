// govk is the Go reference for bench/exec_portforward.py: one virtual-kubelet node built with
// the virtual-kubelet module's node/nodeutil package, serving its kubelet API over TLS.
//
// The provider is our own and deliberately minimal. VK's mock provider makes exec and
// port-forward no-ops, which would measure nothing, so here exec runs the command on this
// machine with os/exec and port-forward dials 127.0.0.1:<port> and copies both ways, the same
// work vkubelet's mock provider does. Pods "run" in memory and are Running at once.
//
// Benchmark tooling, not product code.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	stdlog "log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strconv"
	"sync"
	"syscall"
	"time"

	dto "github.com/prometheus/client_model/go"
	vklog "github.com/virtual-kubelet/virtual-kubelet/log"
	vkslog "github.com/virtual-kubelet/virtual-kubelet/log/slog"
	"github.com/virtual-kubelet/virtual-kubelet/node"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	"github.com/virtual-kubelet/virtual-kubelet/node/nodeutil"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apiserver/pkg/server/dynamiccertificates"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	statsv1alpha1 "k8s.io/kubelet/pkg/apis/stats/v1alpha1"
	utilexec "k8s.io/utils/exec"
)

func main() {
	var (
		kubeconfig = flag.String("kubeconfig", "", "kubeconfig of the cluster")
		nodeName   = flag.String("nodename", "govk", "name of the virtual node")
		address    = flag.String("address", "127.0.0.1", "the node's InternalIP; the kubelet API listens on it")
		port       = flag.Int("port", 10250, "kubelet API port")
		certFile   = flag.String("tls-cert-file", "", "serving certificate (PEM)")
		keyFile    = flag.String("tls-private-key-file", "", "serving key (PEM)")
		clientCA   = flag.String("client-ca-file", "", "CA of the apiserver's kubelet client certificate")
		logLevel   = flag.String("log-level", "info", "debug, info, warn or error")
		version    = flag.Bool("version", false, "print versions and exit")
	)
	flag.Parse()
	if *version {
		fmt.Println(moduleVersion(), runtime.Version())
		return
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		stdlog.Fatal(err)
	}
	vklog.L = vkslog.FromSlog(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})))
	if err := run(*kubeconfig, *nodeName, *address, *port, *certFile, *keyFile, *clientCA); err != nil {
		stdlog.Fatal(err)
	}
}

func run(kubeconfig, nodeName, address string, port int, certFile, keyFile, clientCA string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	// NewNode makes a default client from $KUBECONFIG before it applies options (and warns when
	// there is none); ours, with a higher QPS, replaces it through WithClient.
	if err := os.Setenv("KUBECONFIG", kubeconfig); err != nil {
		return err
	}
	restConfig, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	restConfig.QPS, restConfig.Burst = 100, 200
	client, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		return err
	}

	// Authenticate the apiserver by its client certificate (signed by clientCA) or a bearer
	// token (TokenReview); authorize with SubjectAccessReviews on nodes/<name>/proxy.
	caProvider, err := dynamiccertificates.NewDynamicCAContentFromFile("client-ca", clientCA)
	if err != nil {
		return err
	}
	auth, err := nodeutil.WebhookAuth(client, nodeName, func(c *nodeutil.WebhookAuthConfig) error {
		c.AuthnConfig.ClientCertificateCAContentProvider = caProvider
		return nil
	})
	if err != nil {
		return err
	}

	mux := http.NewServeMux()
	vk, err := nodeutil.NewNode(nodeName,
		func(cfg nodeutil.ProviderConfig) (nodeutil.Provider, node.NodeProvider, error) {
			describeNode(cfg.Node, address, port)
			return newProvider(), nil, nil
		},
		nodeutil.WithClient(client),
		func(cfg *nodeutil.NodeConfig) error {
			cfg.HTTPListenAddr = net.JoinHostPort(address, strconv.Itoa(port))
			cfg.Handler = nodeutil.WithAuth(auth, mux)
			return nil
		},
		nodeutil.AttachProviderRoutes(mux),
		nodeutil.WithTLSConfig(
			nodeutil.WithKeyPairFromPath(certFile, keyFile),
			nodeutil.WithCAFromPath(clientCA),
		),
	)
	if err != nil {
		return err
	}
	go func() {
		if err := vk.WaitReady(ctx, time.Minute); err == nil {
			vklog.G(ctx).Infof("node %s ready, kubelet API on %s:%d", nodeName, address, port)
		}
	}()
	if err := vk.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// describeNode fills in what the scheduler and the apiserver need to know about the node.
func describeNode(n *corev1.Node, address string, port int) {
	capacity := corev1.ResourceList{
		corev1.ResourceCPU:    resource.MustParse("8"),
		corev1.ResourceMemory: resource.MustParse("32Gi"),
		corev1.ResourcePods:   resource.MustParse("110"),
	}
	n.Spec.Taints = []corev1.Taint{{
		Key: "virtual-kubelet.io/provider", Value: "govk", Effect: corev1.TaintEffectNoSchedule,
	}}
	n.Status.Capacity = capacity
	n.Status.Allocatable = capacity
	n.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: address}}
	n.Status.DaemonEndpoints.KubeletEndpoint.Port = int32(port)
	n.Status.NodeInfo.OperatingSystem = "linux"
	n.Status.NodeInfo.Architecture = runtime.GOARCH
	n.Status.NodeInfo.KubeletVersion = moduleVersion()
}

// moduleVersion is the virtual-kubelet module version this binary was built with.
func moduleVersion() string {
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, dep := range info.Deps {
			if dep.Path == "github.com/virtual-kubelet/virtual-kubelet" {
				return "virtual-kubelet/" + dep.Version
			}
		}
	}
	return "virtual-kubelet/unknown"
}

// provider keeps pods in memory; every pod is Running as soon as it is created.
type provider struct {
	mu     sync.Mutex
	pods   map[string]*corev1.Pod
	notify func(*corev1.Pod)
}

func newProvider() *provider {
	return &provider{pods: map[string]*corev1.Pod{}, notify: func(*corev1.Pod) {}}
}

func key(namespace, name string) string { return namespace + "/" + name }

// NotifyPods makes this an asynchronous provider: status changes are pushed, not polled.
func (p *provider) NotifyPods(_ context.Context, notify func(*corev1.Pod)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.notify = notify
}

func (p *provider) CreatePod(_ context.Context, pod *corev1.Pod) error {
	now := metav1.Now()
	pod = pod.DeepCopy()
	pod.Status.Phase = corev1.PodRunning
	pod.Status.StartTime = &now
	pod.Status.PodIP = "127.0.0.1"
	pod.Status.Conditions = []corev1.PodCondition{
		{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.PodInitialized, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.ContainersReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
		{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
	}
	pod.Status.ContainerStatuses = nil
	for _, c := range pod.Spec.Containers {
		pod.Status.ContainerStatuses = append(pod.Status.ContainerStatuses, corev1.ContainerStatus{
			Name: c.Name, Image: c.Image, Ready: true, Started: new(true),
			State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}},
		})
	}
	p.store(pod)
	return nil
}

func (p *provider) UpdatePod(_ context.Context, pod *corev1.Pod) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if old, ok := p.pods[key(pod.Namespace, pod.Name)]; ok {
		updated := pod.DeepCopy()
		updated.Status = old.Status
		p.pods[key(pod.Namespace, pod.Name)] = updated
	}
	return nil
}

func (p *provider) DeletePod(_ context.Context, pod *corev1.Pod) error {
	p.mu.Lock()
	stored, ok := p.pods[key(pod.Namespace, pod.Name)]
	delete(p.pods, key(pod.Namespace, pod.Name))
	notify := p.notify
	p.mu.Unlock()
	if !ok {
		return nil
	}
	now := metav1.Now()
	stored.Status.Phase = corev1.PodSucceeded
	for i := range stored.Status.ContainerStatuses {
		status := &stored.Status.ContainerStatuses[i]
		status.Ready = false
		status.State = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
			Reason: "Completed", FinishedAt: now,
		}}
	}
	go notify(stored)
	return nil
}

func (p *provider) store(pod *corev1.Pod) {
	p.mu.Lock()
	p.pods[key(pod.Namespace, pod.Name)] = pod
	notify := p.notify
	p.mu.Unlock()
	go notify(pod.DeepCopy())
}

func (p *provider) GetPod(_ context.Context, namespace, name string) (*corev1.Pod, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if pod, ok := p.pods[key(namespace, name)]; ok {
		return pod.DeepCopy(), nil
	}
	return nil, nil
}

func (p *provider) GetPodStatus(ctx context.Context, namespace, name string) (*corev1.PodStatus, error) {
	pod, _ := p.GetPod(ctx, namespace, name)
	if pod == nil {
		return nil, nil
	}
	return &pod.Status, nil
}

func (p *provider) GetPods(context.Context) ([]*corev1.Pod, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pods := make([]*corev1.Pod, 0, len(p.pods))
	for _, pod := range p.pods {
		pods = append(pods, pod.DeepCopy())
	}
	return pods, nil
}

func (p *provider) running(namespace, name string) error {
	if pod, _ := p.GetPod(context.Background(), namespace, name); pod == nil {
		return fmt.Errorf("pod %s/%s is not running here", namespace, name)
	}
	return nil
}

// RunInContainer runs the command on this machine, wired to the exec streams.
func (p *provider) RunInContainer(ctx context.Context, namespace, name, _ string, cmd []string, attach api.AttachIO) error {
	if err := p.running(namespace, name); err != nil {
		return err
	}
	if len(cmd) == 0 {
		return errors.New("no command")
	}
	command := exec.CommandContext(ctx, cmd[0], cmd[1:]...)
	if in := attach.Stdin(); in != nil {
		command.Stdin = in
	}
	if out := attach.Stdout(); out != nil {
		command.Stdout = out
	}
	if errOut := attach.Stderr(); errOut != nil {
		command.Stderr = errOut
	}
	err := command.Run()
	var exitErr *exec.ExitError
	if errors.As(err, &exitErr) {
		// The kubelet streaming code reports utilexec.ExitError codes to kubectl.
		return utilexec.CodeExitError{Err: err, Code: exitErr.ExitCode()}
	}
	return err
}

// PortForward dials the port on 127.0.0.1 (the pods "are" this machine) and copies both ways
// until the local server closes its side.
func (p *provider) PortForward(ctx context.Context, namespace, name string, port int32, stream io.ReadWriteCloser) error {
	defer stream.Close()
	if err := p.running(namespace, name); err != nil {
		return err
	}
	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(port))))
	if err != nil {
		return err
	}
	defer conn.Close()
	go func() {
		_, _ = io.Copy(conn, stream)
		_ = conn.(*net.TCPConn).CloseWrite()
	}()
	downstream := make(chan error, 1)
	go func() {
		_, err := io.Copy(stream, conn)
		downstream <- err
	}()
	select {
	case err = <-downstream:
		return err
	case <-ctx.Done():
		return nil
	}
}

// The rest of nodeutil.Provider is not benchmarked.

func (p *provider) GetContainerLogs(context.Context, string, string, string, api.ContainerLogOpts) (io.ReadCloser, error) {
	return nil, errors.ErrUnsupported
}

func (p *provider) AttachToContainer(context.Context, string, string, string, api.AttachIO) error {
	return errors.ErrUnsupported
}

func (p *provider) GetStatsSummary(context.Context) (*statsv1alpha1.Summary, error) {
	return nil, errors.ErrUnsupported
}

func (p *provider) GetMetricsResource(context.Context) ([]*dto.MetricFamily, error) {
	return nil, errors.ErrUnsupported
}
